"""NaiveEP over 2 gloo processes against the single-process kernel, plus placement files.

The two ranks are spawned once for the module: they run every case in `CASES` and save their
outputs; each test then compares one case with NoEP + the reference experts over all tokens.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels import registry
from kernels.config import MoEConfig, RoutingConfig
from kernels.experts.reference import ReferenceExperts
from kernels.modular import ModularKernel
from kernels.placement import Placement
from kernels.prepare_finalize.naive_ep import NaiveEP, pack_rows, unpack_rows
from kernels.prepare_finalize.no_ep import NoEP
from kernels.quant_scheme import QuantConfig
from kernels.routing import contiguous_expert_map, route
from kernels.tensors import Routing
from kernels.testing import random_expert_weights, relative_error
from kernels.workspace import Workspace

WORLD = 2
TIMEOUT_S = 20  # collectives and the whole spawn: a broken rank fails the test, never hangs it


def _cfg(
    experts: int = 4, top_k: int = 2, scheme: str = "none", dtype: torch.dtype = torch.float32
) -> MoEConfig:
    return MoEConfig(
        num_experts=experts,
        hidden_size=256,
        intermediate_size=128,
        routing=RoutingConfig(top_k=top_k),
        quant=QuantConfig(scheme),
        dtype=dtype,
        apply_router_weight_on_input=top_k == 1,
    )


@dataclass(frozen=True)
class Case:
    cfg: MoEConfig = field(default_factory=_cfg)
    counts: tuple[int, int] = (7, 7)  # tokens rank 0 and rank 1 bring
    sequence_parallel: bool = False
    placement: tuple[tuple[int, ...], ...] | None = None  # written to a file; None: contiguous
    max_tokens: int = 64  # per-rank chunk of the modular kernel
    one_expert: int | None = None  # route every token to this expert first
    tol: float = 1e-5


CASES = {
    "equal_counts": Case(),
    "one_token_each": Case(counts=(1, 1)),
    "sequence_parallel_uneven": Case(counts=(5, 9), sequence_parallel=True),
    "sequence_parallel_rank1_brings_none": Case(counts=(6, 0), sequence_parallel=True),
    "sequence_parallel_chunked": Case(counts=(11, 3), sequence_parallel=True, max_tokens=4),
    "fp8_block": Case(_cfg(scheme="fp8-block"), counts=(5, 3), sequence_parallel=True),
    "fp8_token": Case(_cfg(scheme="fp8-token")),
    # the intermediate's per-tensor scale is taken per rank: fp8 noise, not equality
    "fp8_tensor": Case(_cfg(scheme="fp8-tensor"), tol=0.06),
    "uneven_experts": Case(_cfg(experts=5), counts=(4, 6), sequence_parallel=True),
    "placement_file": Case(_cfg(experts=6), placement=((5, 0, 2, 3), (1, 4))),
    "all_tokens_to_one_expert": Case(one_expert=3),
    "router_weight_on_input": Case(_cfg(top_k=1)),
    "bfloat16": Case(_cfg(dtype=torch.bfloat16), counts=(3, 8), sequence_parallel=True, tol=1e-2),
}


def _inputs(case: Case) -> tuple[torch.Tensor, Routing]:
    """Every rank's tokens, rank 0's first: hidden [M, H], routing [M, k]."""
    cfg, m = case.cfg, sum(case.counts)
    gen = torch.Generator().manual_seed(m)
    hidden = torch.randn(m, cfg.hidden_size, generator=gen).to(cfg.dtype)
    logits = torch.randn(m, cfg.num_experts, generator=gen)
    if case.one_expert is not None:
        logits[:, case.one_expert] += 100.0
    return hidden, route(logits, cfg.routing)


def _placement(name: str, files: Path) -> Placement:
    case = CASES[name]
    if case.placement is None:
        return Placement.contiguous(case.cfg.num_experts, WORLD)
    return Placement.from_file(files / f"{name}.json", case.cfg.num_experts, WORLD)


def _run_rank(rank: int, port: int, files: Path) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    outputs = {}
    for name, case in CASES.items():
        kernel = _ep_kernel(name, rank, files)
        hidden, routing = _inputs(case)
        rows = slice(sum(case.counts[:rank]), sum(case.counts[: rank + 1]))
        outputs[name] = kernel.forward(
            hidden[rows], Routing(routing.topk_ids[rows], routing.topk_weights[rows])
        )
    torch.save(outputs, files / f"rank{rank}.pt")
    if rank == 1:  # dies: rank 0's next collective must fail, not wait for it
        dist.barrier()
        return
    dist.barrier()
    time.sleep(1.0)
    kernel = _ep_kernel("equal_counts", rank, files)
    hidden, routing = _inputs(CASES["equal_counts"])
    start = time.monotonic()
    try:
        kernel.forward(hidden[:7], Routing(routing.topk_ids[:7], routing.topk_weights[:7]))
        error = "no error"
    except (RuntimeError, dist.DistError) as err:
        error = f"{type(err).__name__}: {err}"
    (files / "dead_rank.json").write_text(
        json.dumps({"error": error, "seconds": time.monotonic() - start})
    )


def _ep_kernel(name: str, rank: int, files: Path) -> ModularKernel:
    case, placement = CASES[name], _placement(name, files)
    local = torch.tensor(placement.local_experts(rank))
    experts = ReferenceExperts(case.cfg, random_expert_weights(case.cfg, seed=1).select(local))
    return ModularKernel(
        NaiveEP(sequence_parallel=case.sequence_parallel),
        experts,
        Workspace("cpu"),
        expert_map=placement.expert_map(rank),
        max_tokens=case.max_tokens,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    files = tmp_path_factory.mktemp("naive_ep")
    for name, case in CASES.items():
        if case.placement is not None:
            ranks = [list(ids) for ids in case.placement]
            (files / f"{name}.json").write_text(json.dumps({"ranks": ranks}))
    ctx = mp.start_processes(
        _run_rank, args=(_free_port(), files), nprocs=WORLD, start_method="spawn", join=False
    )
    deadline = time.monotonic() + 3 * TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the gloo ranks did not finish in time")
    return files


def _single_process(case: Case) -> torch.Tensor:
    hidden, routing = _inputs(case)
    experts = ReferenceExperts(case.cfg, random_expert_weights(case.cfg, seed=1))
    kernel = ModularKernel(NoEP(), experts, Workspace("cpu"), max_tokens=1 << 20)
    return kernel.forward(hidden, routing)


@pytest.mark.parametrize("name", list(CASES))
def test_two_rank_naive_ep_matches_the_single_process_kernel(ep_run: Path, name: str) -> None:
    case = CASES[name]
    per_rank = [torch.load(ep_run / f"rank{r}.pt")[name] for r in range(WORLD)]
    assert [t.shape[0] for t in per_rank] == list(case.counts)
    expected = _single_process(case)
    assert relative_error(torch.cat(per_rank), expected) < case.tol


def test_a_dead_rank_makes_the_next_forward_fail_fast(ep_run: Path) -> None:
    result = json.loads((ep_run / "dead_rank.json").read_text())
    assert result["error"] != "no error"
    assert result["seconds"] <= TIMEOUT_S + 5


def test_packed_rows_round_trip_every_dtype_and_zero_rows() -> None:
    for m in (0, 3):
        rows = [
            torch.randn(m, 8).to(torch.float8_e4m3fn),
            torch.randint(0, 9, (m, 2), dtype=torch.int32),
            torch.rand(m, 2),
            torch.rand(m, 1),
        ]
        packed = pack_rows(rows)
        assert packed.shape == (m, 8 + 8 + 8 + 4)
        for got, want in zip(unpack_rows(packed, rows), rows, strict=True):
            assert got.dtype == want.dtype and torch.equal(
                got.view(torch.uint8), want.view(torch.uint8)
            )


def test_naive_ep_is_not_offered_without_a_process_group() -> None:
    assert not NaiveEP.supports(torch.device("cpu"))
    assert "process group" in NaiveEP.supports(torch.device("cpu")).reason


@pytest.mark.parametrize(("experts", "world"), [(8, 2), (5, 2), (256, 2), (10, 3)])
def test_contiguous_placement_agrees_with_the_contiguous_expert_map(
    experts: int, world: int
) -> None:
    placement = Placement.contiguous(experts, world)
    for rank in range(world):
        assert torch.equal(placement.expert_map(rank), contiguous_expert_map(experts, rank, world))
    assert sorted(e for r in range(world) for e in placement.local_experts(r)) == list(
        range(experts)
    )


def test_placement_file_maps_global_ids_to_local_order(tmp_path: Path) -> None:
    file = tmp_path / "p.json"
    file.write_text('{"ranks": [[3, 0], [1, 2]]}')
    placement = Placement.from_file(file, num_experts=4, world_size=2)
    assert placement.local_experts(0) == [3, 0]
    assert placement.expert_map(0).tolist() == [1, -1, -1, 0]
    assert placement.expert_map(1).tolist() == [-1, 0, 1, -1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"ranks": [[0, 1], [1, 2, 3]]}', r"on two ranks \[1\]"),
        ('{"ranks": [[0], [1, 2]]}', r"missing \[3\]"),
        ('{"ranks": [[0, 1, 2, 3, 4], []]}', r"out of range \[4\]"),
        ('{"ranks": [[0, 1, 2, 3], []]}', r"ranks \[1\] would hold no experts"),
        ('{"ranks": [[0, 1, 2, 3]]}', "lists 1 ranks, the group has 2"),
        ('{"ranks": [[0, -1], [2, 3]]}', "ranks.0.1"),
        ('{"rank": [[0, 1], [2, 3]]}', "ranks: Field required"),
        ("not json", "Invalid JSON"),
    ],
)
def test_bad_placement_file_is_refused_naming_the_file_and_problem(
    tmp_path: Path, text: str, message: str
) -> None:
    file = tmp_path / "placement.json"
    file.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        Placement.from_file(file, num_experts=4, world_size=2)
    assert str(file) in str(err.value)


def test_missing_placement_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read it"):
        Placement.from_file(tmp_path / "nope.json", num_experts=4, world_size=2)


def test_expert_parallel_selection_pairs_naive_ep_and_names_unfit_backends(
    tiny_config: MoEConfig,
) -> None:
    cpu = torch.device("cpu")
    auto = registry.select(tiny_config, cpu, expert_parallel=True)
    assert auto.experts is ReferenceExperts and auto.prepare_finalize is NaiveEP
    assert "standard format" in auto.rejected["reference-batched"]
    with pytest.raises(ValueError, match=r"reference-batched.*standard format"):
        registry.select(tiny_config, cpu, "reference-batched", expert_parallel=True)
    assert registry.select(tiny_config, cpu).prepare_finalize is NoEP
