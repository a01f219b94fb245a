"""Sessions: token-exact histories held open in the engine, their turns, forks and pins,
and the bounded retention of all they hold.

- records.py: session and pin records, ownership, and the locks they hold;
- manager.py: `SessionManager`, the sessions' API (open, turns, forks, truncate, close);
- pins.py: `Pins`, the named shared prefixes (check, pin, unpin);
- durability.py: `Durability`, durable sessions' and pins' rows (durable.py), detaching,
  resuming and expiring durable sessions;
- session_waits.py: `SessionWaits`, sessions waiting on tools (tool_waits.py: the
  estimates; prefetch.py: bringing a history back);
- tiers.py: `Tiers`, the host and disk tiers as sessions use them;
- retention.py: the retention cap, demotion, eviction priorities, and the count of
  distinct retained tokens;
- host_tier.py + backup.py: the host-memory tier and its glue to sessions;
- controller.py: `SessionController`, the scheduler's one door to all of this (its
  hooks), and `HeldMessages` (messages held while a turn runs its tail); commands.py
  (fork, truncate, close, unpin, list).
"""

from radixlm.runtime.engine.sessions.controller import Intake, SessionController, Turn
from radixlm.runtime.engine.sessions.manager import SessionManager
from radixlm.runtime.engine.sessions.records import HARD, SOFT, PinnedPrefix, Residency, Session
from radixlm.runtime.engine.sessions.retention import DEMOTED_PRIORITY

__all__ = [
    "DEMOTED_PRIORITY",
    "HARD",
    "SOFT",
    "Intake",
    "PinnedPrefix",
    "Residency",
    "Session",
    "SessionController",
    "SessionManager",
    "Turn",
]
