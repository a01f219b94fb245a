"""The ranks' process group: `torch.distributed` over a private file:// rendezvous.

gloo on CPU, NCCL on CUDA (one GPU per rank: rank r on `cuda:(base + r)`). The rendezvous
file lives in a fresh temporary directory the engine makes (0700), so no port is fixed and
parallel engines never meet. The group only carries the forward's all-reduces; each step's
batch travels over a pipe (launch.py), so an idle rank waits on a pipe, not inside a
collective that would time out.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective waits this long for the other ranks before it fails (a rank that hangs
# instead of dying). Every rank runs the same layers, so they meet within one layer's time.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the ranks meet."""

    path: str  # file:// store, in a private temporary directory
    world: int
    device: str  # "cpu" or "cuda:N" (rank 0's; rank r takes N + r)
    timeout_s: float = COLLECTIVE_TIMEOUT_S

    @property
    def backend(self) -> str:
        return "nccl" if torch.device(self.device).type == "cuda" else "gloo"

    def device_of(self, rank: int) -> torch.device:
        base = torch.device(self.device)
        if base.type != "cuda":
            return base
        return torch.device("cuda", (base.index or 0) + rank)


class TPGroup:
    """This process's membership of the group: `all_reduce` sums over the ranks.

    A process group object of its own (not torch's default group, which is one per
    process): nothing global is set, and one process may hold several (tests)."""

    def __init__(self, rendezvous: Rendezvous, rank: int) -> None:
        self.rank = rank
        self.world = rendezvous.world
        self.device = rendezvous.device_of(rank)
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        store = dist.FileStore(rendezvous.path, rendezvous.world)
        if rendezvous.backend == "nccl":
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, rendezvous.world, options)
        else:
            self._pg = dist.ProcessGroupGloo(store, rank, rendezvous.world, timeout)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""
        self._pg.allreduce([t]).wait()

    def close(self) -> None:
        self._pg = None  # its connections close with it
