"""Where the expert-parallel ranks meet: a TCPStore served by rank 0, on one host or several.

    MASTER_ADDR:MASTER_PORT (torch.distributed's usual environment; default 127.0.0.1, a free port)
    spec            rank 0's RankSpec (JSON): the layers, their placements, the backend
    status/<r>      rank r has loaded its experts ("") or why it could not
    cmd/<n>         rank 0's n-th command, read by every other rank in order (JSON)
    beat/<r>        a counter rank r adds to every HEARTBEAT_S: rank 0 sees a silent rank
    abort/<g>       set before generation g is replaced: every rank aborts g's group, so a rank
                    blocked in one of its collectives returns
    gen<g>/...      the rendezvous of generation g's process group among the live ranks

Commands go through the store rather than a collective: an idle rank waits on the store, never
inside a collective that would time out, and a rank on another host reads them the same way.
A rank dying breaks its group for good, so the survivors form the next generation's group (a
new ProcessGroup under a new prefix, outside torch.distributed's default group).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
# The longest a caller waits for NCCL's abort of a generation's communicators (see
# Generation.abort); it goes on in the background past that.
ABORT_WAIT_S = 5.0
WAIT_POLL_S = 50e-6  # gloo: how often a wait on a collective checks for an abort
KEEP_COMMANDS = 256  # commands kept in the store (every live rank reads one before the next)


@dataclass(frozen=True)
class Rendezvous:
    host: str
    port: int
    world_size: int

    @classmethod
    def for_rank0(cls, world_size: int) -> Rendezvous:
        """MASTER_ADDR and MASTER_PORT when set (other hosts join there), else a free port on
        127.0.0.1 (every rank on this host)."""
        port = os.environ.get("MASTER_PORT")
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        return cls(host, int(port) if port else free_port(), world_size)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(rv: Rendezvous, rank: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 serves the store; the others connect to it (waiting up to `timeout_s`)."""
    return dist.TCPStore(
        rv.host,
        rv.port,
        rv.world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


@dataclass(frozen=True)
class Generation:
    """One group among the live ranks; the next replaces it when a rank dies."""

    number: int
    members: tuple[int, ...]  # global ranks; group rank i is members[i]
    group: dist.ProcessGroup
    aborted: threading.Event  # set once a member is known dead: stop waiting on collectives
    poll: bool  # gloo: waits poll `aborted` (its abort does not wake a blocked wait)
    # held from the first abort on
    _aborting: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def abort(self) -> None:
        """Make collectives of this group return: NCCL aborts them; gloo waits see `aborted`.
        The first call aborts, later ones return at once. NCCL's abort of communicators whose
        collectives were captured in CUDA graphs took its whole timeout (60 s) on 2 x H200,
        on healthy ranks too (pytorch/pytorch#115388 reports the like for
        destroy_process_group): it runs on a thread of its own, waited for ABORT_WAIT_S at
        most, so no shutdown or regroup waits for it."""
        self.aborted.set()
        if not self._aborting.acquire(blocking=False):
            return
        aborting = threading.Thread(
            target=self._abort_group, name=f"moe-serve-ep-abort-{self.number}", daemon=True
        )
        aborting.start()
        aborting.join(ABORT_WAIT_S)
        if aborting.is_alive():
            log.warning(
                "the expert-parallel group of generation %d is still aborting after %.0f s; "
                "going on without it",
                self.number,
                ABORT_WAIT_S,
            )

    def _abort_group(self) -> None:
        with contextlib.suppress(RuntimeError, AttributeError, NotImplementedError):
            self.group.abort()

    def wait(self, work: dist.Work) -> None:
        """Wait for a collective of this group; RuntimeError once the group is aborted. With
        NCCL, wait() only orders the current stream after the collective: no host wait."""
        if self.poll:
            while not work.is_completed():
                if self.aborted.is_set():
                    raise RuntimeError("the expert-parallel group was aborted: a rank died")
                time.sleep(WAIT_POLL_S)
        work.wait()


def make_group(
    store: dist.Store,
    number: int,
    members: list[int],
    rank: int,
    device: torch.device,
    timeout_s: float,
) -> Generation:
    """Generation `number`'s group among `members` (global ranks; this rank is group rank
    members.index(rank)): NCCL on GPUs, gloo on the CPU. Blocks until every member joins."""
    prefixed = dist.PrefixStore(f"gen{number}/", store)
    index, size, timeout = members.index(rank), len(members), timedelta(seconds=timeout_s)
    if device.type == "cuda":
        # 2: on a collective error the watchdog aborts the communicators but leaves the process
        # alone (the default tears it down), so the survivors can form the next generation
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, index, size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, index, size, timeout)
    return Generation(number, tuple(members), group, threading.Event(), device.type != "cuda")


class Commands:
    """Rank 0 posts numbered commands; every other rank reads each one, in order."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.seq = 0  # the last command posted (rank 0) or read (the others)
        self._pruned = 0  # commands up to this one are deleted from the store

    def post(self, **command: object) -> None:
        self.seq += 1
        self.store.set(f"cmd/{self.seq}", json.dumps(command))

    def prune(self) -> None:
        """Delete all but the last KEEP_COMMANDS commands (rank 0, off the forward's path)."""
        while self._pruned < self.seq - KEEP_COMMANDS:
            self._pruned += 1
            self.store.delete_key(f"cmd/{self._pruned}")

    def next(self) -> dict | None:
        """The next command; None once rank 0's store is gone (rank 0 exited). One round trip:
        the store answers the get once the key is set (or after the client's timeout)."""
        key = f"cmd/{self.seq + 1}"
        while True:
            try:
                command = self.store.get(key)
                break
            except (RuntimeError, dist.DistError):
                if not store_alive(self.store):
                    return None
        self.seq += 1
        return json.loads(command)


def store_alive(store: dist.Store) -> bool:
    try:
        store.check(["spec"])
    except (RuntimeError, dist.DistError):
        return False
    return True


def leave(status: int) -> NoReturn:
    """Exit without running destructors: torch's process groups and store clients, torn down
    at interpreter exit with their threads still running, call std::terminate, and NCCL's
    abort of a group whose collectives were captured in CUDA graphs waited its whole 60 s
    timeout there and then hung (2 x H200). Ranks 1..N-1 always end through here, rank 0's
    process on GPUs (`serve --ep`, bench.ep_service)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
