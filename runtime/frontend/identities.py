"""Client identities are the server's to assign, never the peer's.

libzmq's ROUTER names each connection that does not choose a routing id itself with a
5-byte id: a zero byte, then a 32-bit counter that starts at libc's ``rand()``. It never
checks that id against the ids peers chose for themselves: a peer that takes the id the
next anonymous connection will get makes libzmq assert (``socket_base.cpp``) and the
frontend die. Unseeded, ``rand()``'s first value is the same in every process, so that id
was known to everyone. Two defences, together:

- `unpredictable_routing_ids`: seed ``rand()`` from the OS's randomness before the ROUTER
  is made, so the ids it assigns cannot be foreseen (and they are never shown to clients);
- `assigned_by_server`: the frontend serves only connections whose id libzmq assigned
  (ROUTER_HANDOVER stays off: a peer naming a live connection's id is ignored by libzmq);
  a peer that sets ``ZMQ_ROUTING_ID`` itself is refused, so no peer-chosen id can stand
  for another connection, now or after it leaves.
"""

from __future__ import annotations

import ctypes
import logging
import secrets

__all__ = ["REFUSED_IDENTITY", "assigned_by_server", "unpredictable_routing_ids"]

log = logging.getLogger("radixlm.frontend")

REFUSED_IDENTITY = ("this server assigns client identities: connect without setting "
                    "ZMQ_ROUTING_ID (a peer-chosen routing id is refused)")


def unpredictable_routing_ids() -> None:
    """Seed libc's ``rand()``, which libzmq's ROUTER starts its id counter from (call it
    before the client socket is created)."""
    try:
        libc = ctypes.CDLL(None)
        libc.srand(ctypes.c_uint(secrets.randbits(32)))
    except (OSError, AttributeError):  # no libc rand to seed: ids stay libzmq's own
        log.warning("could not seed libc rand(): client routing ids are predictable")


def assigned_by_server(identity: bytes) -> bool:
    """Whether `identity` has the shape of the ids libzmq assigns (a zero byte and four
    more). A peer may still choose one of that shape; seeded, it cannot know which ones
    libzmq will assign, and one naming a live connection is ignored by libzmq."""
    return len(identity) == 5 and identity[0] == 0
