"""Placements with replicated experts, and NaiveEP's sender mode, over 3 gloo processes.

The ranks are spawned once for the module. They form their group outside the default one (a
ProcessGroupGloo on a prefixed TCPStore, as the service does), run every case in `CASES` with
rank 0 bringing all tokens, and rank 0 saves the outputs; each test compares one case with NoEP
+ the reference experts over all tokens in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.placement import Placement, balancedness, rank_tokens
from moe_serve.kernels.prepare_finalize.naive_ep import NaiveEP
from moe_serve.kernels.prepare_finalize.no_ep import NoEP
from moe_serve.kernels.quant_scheme import QuantConfig
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.routing import route, to_local_ids
from moe_serve.kernels.tensors import Routing
from moe_serve.kernels.workspace import Workspace
from tests.kernels.ranks import run_ranks

WORLD = 3
TIMEOUT_S = 20


def _cfg(experts: int = 6, scheme: str = "none") -> MoEConfig:
    return MoEConfig(
        num_experts=experts,
        hidden_size=128,
        intermediate_size=64,
        routing=RoutingConfig(top_k=2),
        quant=QuantConfig(scheme),
    )


@dataclass(frozen=True)
class Case:
    cfg: MoEConfig = field(default_factory=_cfg)
    tokens: int = 13
    placement: tuple[tuple[int, ...], ...] = ((0, 1), (2, 3), (4, 5))
    chunk_tokens: int = 64
    one_expert: int | None = None  # route every token to this expert first
    tol: float = 1e-5


REPLICATED = ((0, 1, 5), (2, 3, 0), (4, 5, 0))  # expert 0 on every rank, 5 on two
CASES = {
    "no_replicas": Case(),
    "replicas": Case(placement=REPLICATED),
    "one_token": Case(tokens=1, placement=REPLICATED),
    "all_tokens_to_a_replicated_expert": Case(placement=REPLICATED, one_expert=0),
    "all_tokens_to_a_single_copy_expert": Case(placement=REPLICATED, one_expert=3),
    "chunked": Case(tokens=11, placement=REPLICATED, chunk_tokens=4),
    "every_expert_everywhere": Case(placement=((0, 1, 2, 3, 4, 5),) * 3),
    "fp8_block": Case(_cfg(scheme="fp8-block"), placement=REPLICATED),
    "fp8_tensor": Case(_cfg(scheme="fp8-tensor"), placement=REPLICATED, tol=0.06),
}


def _inputs(case: Case) -> tuple[torch.Tensor, Routing]:
    cfg = case.cfg
    gen = torch.Generator().manual_seed(case.tokens)
    hidden = torch.randn(case.tokens, cfg.hidden_size, generator=gen)
    logits = torch.randn(case.tokens, cfg.num_experts, generator=gen)
    if case.one_expert is not None:
        logits[:, case.one_expert] += 100.0
    return hidden, route(logits, cfg.routing)


def _run_rank(rank: int, port: int, files: Path) -> None:
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=TIMEOUT_S))
    group = dist.ProcessGroupGloo(
        dist.PrefixStore("gen1", store), rank, WORLD, timedelta(seconds=TIMEOUT_S)
    )
    outputs, runs = {}, {}
    for name, case in CASES.items():
        placement = Placement(case.placement, case.cfg.num_experts)
        local = torch.tensor(placement.local_experts(rank))
        experts = ReferenceExperts(case.cfg, random_expert_weights(case.cfg, seed=1).select(local))
        kernel = ModularKernel(
            NaiveEP(group, sender=0),
            experts,
            Workspace("cpu"),
            expert_map=placement.replica_map(rank),
            chunk_tokens=case.chunk_tokens,
        )
        hidden, routing = _inputs(case)
        if rank != 0:  # a placeholder of the same shape: the rows come from rank 0
            hidden = torch.zeros_like(hidden)
            routing = Routing(torch.zeros_like(routing.topk_ids), routing.topk_weights * 0)
        outputs[name] = kernel.forward(hidden, routing)
        runs[name] = (kernel, hidden, routing)
    reads = {}
    for name in NO_SYNC_CASES:  # a second forward of each, the stage's host reads noted
        kernel, hidden, routing = runs[name]
        with _host_reads(kernel.prepare_finalize) as reads[name]:
            kernel.forward(hidden, routing)
    torch.save(reads, files / f"host_reads{rank}.pt")
    if rank == 0:
        torch.save(outputs, files / "outputs.pt")
    group.barrier().wait()


NO_SYNC_CASES = ("replicas", "chunked", "fp8_block", "all_tokens_to_a_replicated_expert")
_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def _host_reads(stage: NaiveEP) -> Iterator[list[str]]:
    """Notes each tensor value read on the host (each one a sync on a GPU) inside the stage's
    methods (the reference experts, an oracle, read freely)."""
    reads: list[str] = []
    inside = [False]
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def noting(name: str) -> Callable:
        def read(self: torch.Tensor, *args: object) -> object:
            if inside[0]:
                reads.append(name)
            return originals[name](self, *args)

        return read

    def watched(method: Callable) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            inside[0] = True
            try:
                return method(*args, **kwargs)
            finally:
                inside[0] = False

        return call

    for name in _HOST_READS:
        setattr(torch.Tensor, name, noting(name))
    for method in ("planned_tokens", "prepare", "finalize"):
        setattr(stage, method, watched(getattr(stage, method)))
    try:
        yield reads
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
        for method in ("planned_tokens", "prepare", "finalize"):
            delattr(stage, method)


@pytest.fixture(scope="module")
def ep_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    files = tmp_path_factory.mktemp("ep_replicas")
    run_ranks(_run_rank, (files,), WORLD, 3 * TIMEOUT_S)
    return files


@pytest.fixture(scope="module")
def ep_run(ep_files: Path) -> dict[str, torch.Tensor]:
    return torch.load(ep_files / "outputs.pt")


def _single_process(case: Case) -> torch.Tensor:
    hidden, routing = _inputs(case)
    experts = ReferenceExperts(case.cfg, random_expert_weights(case.cfg, seed=1))
    return ModularKernel(NoEP(), experts, Workspace("cpu")).forward(hidden, routing)


@pytest.mark.parametrize("name", list(CASES))
def test_sender_mode_over_three_ranks_matches_one_process(
    ep_run: dict[str, torch.Tensor], name: str
) -> None:
    case = CASES[name]
    assert relative_error(ep_run[name], _single_process(case)) < case.tol


@pytest.mark.parametrize("rank", range(WORLD))
def test_the_sender_mode_forward_reads_nothing_back_on_any_rank(ep_files: Path, rank: int) -> None:
    reads = torch.load(ep_files / f"host_reads{rank}.pt")
    assert reads == {name: [] for name in NO_SYNC_CASES}


# ---- placements and replica tables -----------------------------------------------------------


def test_each_pair_of_a_replicated_expert_goes_to_exactly_one_rank_split_by_token() -> None:
    placement = Placement(REPLICATED, 6)
    ids = torch.tensor([[0, 5]] * 6 + [[-1, 0]], dtype=torch.int32)
    held = [to_local_ids(ids, placement.replica_map(r)) >= 0 for r in range(WORLD)]
    assert torch.equal(sum(h.int() for h in held), (ids >= 0).int())  # one rank per pair
    # expert 0 (3 copies): token t on rank t % 3; expert 5 (ranks 0, 2): token t on [0, 2][t % 2]
    assert [int(h[t, 0]) for t in range(6) for h in held] == [
        int(r == t % 3) for t in range(6) for r in range(WORLD)
    ]
    assert [r for t in range(6) for r in range(WORLD) if held[r][t, 1]] == [0, 2] * 3
    # local ids: expert 0 is local 2 on rank 0 and 2 on ranks 1, 2 (their third entries)
    assert to_local_ids(ids, placement.replica_map(1))[1].tolist() == [2, -1]


def test_rank_tokens_and_balancedness_follow_the_replicas() -> None:
    placement = Placement(REPLICATED, 6)
    ids = torch.tensor([[0, 5]] * 6 + [[-1, 0]], dtype=torch.int32)
    tokens = rank_tokens(ids, placement.owner_map(), WORLD)
    # expert 0: tokens 0..6 -> ranks 0,1,2,0,1,2,0; expert 5: tokens 0..5 -> ranks 0,2,0,2,0,2
    assert tokens.tolist() == [3 + 3, 2, 2 + 3]
    assert balancedness(tokens).item() == pytest.approx((13 / 3) / 6)
    assert balancedness(torch.zeros(3, dtype=torch.int64)).item() == 1.0


def test_one_copy_placements_keep_the_plain_expert_map_and_minus_one_stays_nowhere() -> None:
    placement = Placement(((3, 0), (1, 2)), 4)
    ids = torch.tensor([[0, 3], [1, -1]], dtype=torch.int32)
    for rank in range(2):
        assert torch.equal(
            to_local_ids(ids, placement.replica_map(rank)),
            to_local_ids(ids, placement.expert_map(rank)),
        )
    assert to_local_ids(ids, placement.expert_map(0)).tolist() == [[1, 0], [-1, -1]]
    with pytest.raises(ValueError, match="replica_map"):
        Placement(REPLICATED, 6).expert_map(0)


def test_redundant_copies_go_to_the_hottest_experts_on_the_least_loaded_ranks() -> None:
    base = Placement.contiguous(6, 3)  # (0, 1) (2, 3) (4, 5)
    counts = [90, 10, 5, 5, 30, 0]
    one = base.with_redundant(counts, 1)
    assert one.ranks == ((0, 1), (2, 3, 0), (4, 5))  # expert 0 onto rank 1 (load 10)
    two = base.with_redundant(counts, 2)
    # per copy: expert 0 now 45, expert 4 30; 0 again, onto rank 2 (load 30 < 55, 55)
    assert two.ranks == ((0, 1), (2, 3, 0), (4, 5, 0))
    assert max(two.rank_loads(counts)) < max(base.rank_loads(counts))
    with pytest.raises(ValueError, match="do not fit"):
        base.with_redundant(counts, 13)


def test_balanced_placement_spreads_hot_experts_and_keeps_slots_even() -> None:
    counts = [100, 90, 1, 1, 1, 1]
    placement = Placement.balanced(counts, 3)
    assert [len(ids) for ids in placement.ranks] == [2, 2, 2]
    owner = {e: r for r, ids in enumerate(placement.ranks) for e in ids}
    assert owner[0] != owner[1]
    assert Placement.balanced(counts, 3, redundant=2).replicated


def test_surviving_placement_keeps_local_ids_or_names_the_lost_experts() -> None:
    covered = Placement(((0, 1, 2), (2, 3, 0), (3, 1)), 4)  # every expert on two ranks
    assert covered.surviving([0, 2]).ranks == ((0, 1, 2), (3, 1))
    assert covered.surviving([1, 2]).replica_map(0).tolist() == [
        [1, 2, -1],
        [1, -1, -1],
        [1, 0, -1],
        [2, 1, -1],
    ]
    with pytest.raises(ValueError, match=r"experts \[2, 3\] have no copy on a live rank"):
        Placement(REPLICATED, 6).surviving([0, 2])


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        (((0, 1, 1), (2, 3)), r"rank 0 lists experts \[1\] more than once"),
        (((0, 1), (2,)), r"missing \[3\]"),
        (((0, 1, 2, 3, 4), ()), r"out of range \[4\]"),
        (((0, 1, 2, 3), ()), r"ranks \[1\] would hold no experts"),
    ],
)
def test_bad_placements_are_refused(ranks: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Placement(ranks, 4)
