"""service/ep/group.py's command channel over a real TCPStore, in one process."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from moe_serve.service.ep import group as ep_group
from moe_serve.service.ep.group import KEEP_COMMANDS, Commands, Rendezvous, connect, make_group


@pytest.fixture
def stores() -> tuple[dist.TCPStore, dist.TCPStore]:
    rv = Rendezvous.for_rank0(2)
    return connect(rv, 0, 5.0), connect(rv, 1, 5.0)


def test_commands_arrive_in_order_and_old_ones_are_pruned(stores) -> None:
    rank0, rank1 = stores
    rank0.set("spec", "{}")
    posted, read = Commands(rank0), Commands(rank1)
    for n in range(KEEP_COMMANDS + 10):
        posted.post(op="forward", n=n)
        assert read.next() == {"op": "forward", "n": n}
    posted.prune()
    assert not rank0.check([f"cmd/{10}"]) and rank0.check([f"cmd/{11}"])
    assert rank0.num_keys() <= KEEP_COMMANDS + 1  # + spec


def test_a_waiting_rank_gets_a_command_posted_later(stores) -> None:
    rank0, rank1 = stores
    rank0.set("spec", "{}")
    got = []
    reader = threading.Thread(target=lambda: got.append(Commands(rank1).next()))
    reader.start()
    Commands(rank0).post(op="exit")
    reader.join(5)
    assert got == [{"op": "exit"}]


def test_an_aborted_generation_stops_a_gloo_wait_that_would_never_end(stores) -> None:
    rank0, rank1 = stores
    gens = []
    # rank 1 joins the group but never takes part in the collective below
    joined = threading.Thread(
        target=lambda: gens.append(make_group(rank1, 0, [0, 1], 1, torch.device("cpu"), 1.0))
    )
    joined.start()
    gen = make_group(rank0, 0, [0, 1], 0, torch.device("cpu"), 1.0)
    joined.join(5)
    work = gen.group.reduce(torch.ones(4), 0, dist.ReduceOp.SUM)
    threading.Timer(0.2, gen.aborted.set).start()  # as Generation.abort, gloo's part
    with pytest.raises(RuntimeError, match="aborted: a rank died"):
        gen.wait(work)
    for g in (gen, *gens):
        g.abort()


class _StuckGroup:
    """A process group whose abort blocks, as NCCL's did on 2 x H200 after CUDA graphs."""

    def __init__(self) -> None:
        self.aborts = 0
        self.release = threading.Event()

    def abort(self) -> None:
        self.aborts += 1
        self.release.wait(30)


def test_an_abort_that_hangs_holds_its_caller_for_abort_wait_s_at_most_and_runs_once(
    monkeypatch,
) -> None:
    monkeypatch.setattr(ep_group, "ABORT_WAIT_S", 0.2)
    stuck = _StuckGroup()
    gen = ep_group.Generation(3, (0, 1), stuck, threading.Event(), poll=False)
    started = time.monotonic()
    gen.abort()
    gen.abort()  # a second caller (the heartbeat, the watch thread) returns at once
    assert time.monotonic() - started < 2.0
    assert gen.aborted.is_set() and stuck.aborts == 1
    stuck.release.set()
