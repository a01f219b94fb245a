"""Pins across replicas: which replicas hold each pin, where a session opened from a pin
goes, and placing a pin on another replica (the router's own ``pin`` request, a
`Placement`) when it must be there first.

A pin lives where it was pinned; a session opened from it goes to one of its holders. A
pin used `hot_pin_uses` times is placed on every live replica, so its sessions spread.
The engine registers a pin once its prefill is done, so an open bound for a replica the
pin is still being placed on waits for the placement's answer (`when_held`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixlm.runtime import protocol as wire
from radixlm.runtime.router.host import Host
from radixlm.runtime.router.records import Client, Pending, PinRecord, Placement
from radixlm.runtime.router.sessions import SessionTable

__all__ = ["PinPlacement"]

log = logging.getLogger("radixlm.router")

Waiter = Callable[[bool, "wire.Error | None"], None]


class PinPlacement:
    def __init__(self, host: Host, sessions: SessionTable) -> None:
        self.host = host
        self.sessions = sessions
        self.pins: dict[tuple[str | None, str], PinRecord] = {}  # by (tenant, name)

    def get(self, tenant: str | None, name: str) -> PinRecord | None:
        return self.pins.get((tenant, name))

    def home(self, client: Client, pin: PinRecord, live: list[int]) -> int:
        """Where a session opened from `pin` goes: of its live holders and the replicas it
        is being placed on, the one homing fewest sessions (then the least loaded; an
        open on a replica still placing it waits for the placement's answer:
        `PinRecord.waiters`); with none, one where routing places it again (its input is
        kept). A pin used `hot_pin_uses` times is
        placed on every live replica; a replica holds it once it has said so."""
        pin.uses += 1
        if pin.uses >= self.host.config.hot_pin_uses:
            pin.everywhere = True
        alive = set(live)
        if pin.everywhere:
            for replica in live:
                if replica not in pin.holders and replica not in pin.placing:
                    self.place(client, pin, replica)
        # A replica it is being placed on counts as one (an open there waits for the
        # placement's answer): a burst of opens right after the pin went hot spreads,
        # instead of all going to the first holder while the others' placements run.
        candidates = (pin.holders | pin.placing) & alive
        if candidates:
            # sessions homed first: a session's load comes later (its turns), and one
            # waiting for a placement has none yet, so load first sent a burst of opens
            # all to the replica still placing the pin
            homed, loads = self.sessions.homed, self.host.routing.loads
            return min(candidates, key=lambda i: (homed[i], loads[i], i))
        replica = self.host.routing.place(pin.key, live, pin.msg_input, 0)[0]
        self.place(client, pin, replica)
        return replica

    def place(self, client: Client, pin: PinRecord, replica: int) -> None:
        """Pin `pin` on `replica` too, over `client`'s link."""
        rid = self.host.internal_rid()
        self.host.jobs[rid] = Placement(pin, replica, client.ident)
        pin.placing.add(replica)
        self.host.send(client, replica, wire.Pin(rid=rid, name=pin.name, input=pin.msg_input,
                                                 namespace=pin.namespace))
        self.host.routing.tree.insert(pin.key, replica)

    def when_held(self, pin: PinRecord, replica: int, go: Waiter) -> None:
        """``go(True, None)`` once `replica` holds `pin` (now, if it does); else ``go(False,
        error)`` when it refused, ``go(False, None)`` when the placement was cut off."""
        if replica in pin.holders:
            go(True, None)
        else:
            pin.waiters.setdefault(replica, []).append(go)

    def placement_reply(self, job: Placement, replica: int, msg: wire.ServerMessage) -> None:
        error = msg if isinstance(msg, wire.Error) else None
        held = error is None or error.code == wire.ErrorCode.DUPLICATE_ID  # (already)
        if not held:
            log.warning("placing a pin on replica %d failed: %s", replica, msg)
        self.placed(job.pin, replica, held, None if held else error)

    def placed(self, pin: PinRecord, replica: int, held: bool,
               error: wire.Error | None) -> None:
        """A placement answered (or cut off): run what waited for it."""
        pin.placing.discard(replica)
        if held:
            pin.holders.add(replica)
        for waiter in pin.waiters.pop(replica, []):
            waiter(held, error)

    def pinned(self, client: Client, replica: int, p: Pending, pinned: wire.Pinned) -> None:
        """A client's pin was made on `replica`."""
        msg = wire.decode_client(p.frame)
        assert isinstance(msg, wire.Pin)
        key = self.host.routing.key(client.tenant, msg.namespace, msg.input, None)
        pin = self.pins.get((client.tenant, msg.name))
        if pin is None:
            pin = PinRecord(msg.name, client.tenant, msg.input, msg.namespace, key, pinned.length)
            self.pins[(client.tenant, msg.name)] = pin
        pin.holders.add(replica)
        self.host.routing.tree.insert(key, replica)

    def replica_gone(self, replica: int) -> None:
        """`replica` is down: it holds nothing, and its placements are cut off."""
        jobs = self.host.jobs
        for rid, job in list(jobs.items()):
            if isinstance(job, Placement) and job.replica == replica:
                del jobs[rid]
        for pin in self.pins.values():
            pin.holders.discard(replica)
            self.placed(pin, replica, False, None)

    def client_gone(self, ident: bytes) -> None:
        """The placements over a departed client's links are cut off (what waited for
        them is routed again)."""
        jobs = self.host.jobs
        for rid, job in list(jobs.items()):
            if isinstance(job, Placement) and job.client == ident:
                del jobs[rid]
                self.placed(job.pin, job.replica, False, None)
