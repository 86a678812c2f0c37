"""NaiveEP over 2 gloo processes against the single-process kernel, plus placement files.

The two ranks are spawned once for the module: they run every case in `CASES` and save their
outputs; each test then compares one case with NoEP + the reference experts over all tokens.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_serve.bench.random_layer import random_layer
from moe_serve.bench.shapes import SHAPES
from moe_serve.kernels import registry, selection
from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.experts import triton as triton_experts
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.experts.triton import TritonExperts
from moe_serve.kernels.layer import LayerWeights, RouterWeights, build_layer
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.placement import Placement
from moe_serve.kernels.prepare_finalize import naive_ep
from moe_serve.kernels.prepare_finalize.naive_ep import (
    NaiveEP,
    column_blocks,
    pack_rows,
    pack_segments,
    received_like,
    unpack_rows,
    unpack_segments,
)
from moe_serve.kernels.prepare_finalize.no_ep import NoEP, dispatch_locally
from moe_serve.kernels.quant_scheme import ActQuant, QuantConfig
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.routing import contiguous_expert_map, route
from moe_serve.kernels.stages import DispatchSpec, Experts, SideOutput
from moe_serve.kernels.tensors import Routing
from moe_serve.kernels.workspace import Workspace
from moe_serve.weights.placement_file import read_expert_counts, read_placement
from tests.kernels.ranks import run_ranks

log = logging.getLogger(__name__)

WORLD = 2
TIMEOUT_S = 20  # collectives and the whole spawn: a broken rank fails the test, never hangs it


def _cfg(
    experts: int = 4,
    top_k: int = 2,
    scheme: str = "none",
    dtype: torch.dtype = torch.float32,
    hidden: int = 256,
) -> MoEConfig:
    return MoEConfig(
        num_experts=experts,
        hidden_size=hidden,
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
    chunk_tokens: int = 64  # per-rank chunk of the modular kernel
    one_expert: int | None = None  # route every token to this expert first
    tol: float = 1e-5
    # the service's mode: rank 0 brings counts[0] tokens, rank 1 a placeholder of that shape
    sender: bool = False
    shared: bool = False  # rank 0 adds a shared experts' output (sender cases)


CASES = {
    "equal_counts": Case(),
    "one_token_each": Case(counts=(1, 1)),
    "sequence_parallel_uneven": Case(counts=(5, 9), sequence_parallel=True),
    "sequence_parallel_rank1_brings_none": Case(counts=(6, 0), sequence_parallel=True),
    "sequence_parallel_chunked": Case(counts=(11, 3), sequence_parallel=True, chunk_tokens=4),
    "fp8_block": Case(_cfg(scheme="fp8-block"), counts=(5, 3), sequence_parallel=True),
    "fp8_token": Case(_cfg(scheme="fp8-token")),
    # the intermediate's per-tensor scale is taken per rank: fp8 noise, not equality
    "fp8_tensor": Case(_cfg(scheme="fp8-tensor"), tol=0.06),
    "uneven_experts": Case(_cfg(experts=5), counts=(4, 6), sequence_parallel=True),
    "placement_file": Case(_cfg(experts=6), placement=((5, 0, 2, 3), (1, 4))),
    "all_tokens_to_one_expert": Case(one_expert=3),
    "router_weight_on_input": Case(_cfg(top_k=1)),
    "bfloat16": Case(_cfg(dtype=torch.bfloat16), counts=(3, 8), sequence_parallel=True, tol=1e-2),
    # the service's mode: rank 0 brings every row, rank 1 a placeholder; the sum is reduced onto it
    "sender": Case(counts=(7, 0), sender=True),
    "sender_shared": Case(counts=(9, 0), sender=True, shared=True),
    "sender_bfloat16": Case(_cfg(dtype=torch.bfloat16), counts=(6, 0), sender=True, tol=1e-2),
    # fp8 rows and their scales travel; a sender holds the whole batch, so its tensor scale too
    "sender_fp8_block": Case(_cfg(scheme="fp8-block"), counts=(5, 0), sender=True),
    "sender_fp8_tensor": Case(_cfg(scheme="fp8-tensor"), counts=(8, 0), sender=True, tol=0.06),
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
    return read_placement(files / f"{name}.json", case.cfg.num_experts, WORLD)


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
        if case.sender:
            if rank != 0:  # a placeholder: the rows come from rank 0
                hidden, routing = torch.zeros_like(hidden), _placeholder(routing)
            shared = _shared(hidden) if rank == 0 and case.shared else None
            outputs[name] = kernel.forward(hidden, routing, shared=shared)
            continue
        rows = slice(sum(case.counts[:rank]), sum(case.counts[: rank + 1]))
        outputs[name] = kernel.forward(
            hidden[rows], Routing(routing.topk_ids[rows], routing.topk_weights[rows])
        )
    torch.save(outputs, files / f"rank{rank}.pt")
    if rank == 1:  # dies: rank 0's next collective must fail, not wait for it
        dist.barrier()
        os._exit(0)
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
    os._exit(0)  # a broken gloo group aborts in its destructors; leave without running them


def _placeholder(routing: Routing) -> Routing:
    return Routing(torch.zeros_like(routing.topk_ids), torch.zeros_like(routing.topk_weights))


def _shared(hidden: torch.Tensor) -> Callable[[], SideOutput]:
    """A stand-in for the shared experts' float32 output [M, H] (a function of the rows)."""
    return lambda: SideOutput(hidden.float().tanh() * 0.5)


def _ep_kernel(name: str, rank: int, files: Path) -> ModularKernel:
    case, placement = CASES[name], _placement(name, files)
    local = torch.tensor(placement.local_experts(rank))
    experts = ReferenceExperts(case.cfg, random_expert_weights(case.cfg, seed=1).select(local))
    return ModularKernel(
        NaiveEP(sequence_parallel=case.sequence_parallel, sender=0 if case.sender else None),
        experts,
        Workspace("cpu"),
        expert_map=placement.expert_map(rank),
        chunk_tokens=case.chunk_tokens,
    )


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    files = tmp_path_factory.mktemp("naive_ep")
    for name, case in CASES.items():
        if case.placement is not None:
            ranks = [list(ids) for ids in case.placement]
            (files / f"{name}.json").write_text(json.dumps({"ranks": ranks}))
    run_ranks(_run_rank, (files,), WORLD, 3 * TIMEOUT_S)
    return files


def _single_process(case: Case) -> torch.Tensor:
    hidden, routing = _inputs(case)
    experts = ReferenceExperts(case.cfg, random_expert_weights(case.cfg, seed=1))
    kernel = ModularKernel(NoEP(), experts, Workspace("cpu"), chunk_tokens=1 << 20)
    shared = _shared(hidden) if case.shared else None
    return kernel.forward(hidden, routing, shared=shared)


@pytest.mark.parametrize("name", list(CASES))
def test_two_rank_naive_ep_matches_the_single_process_kernel(ep_run: Path, name: str) -> None:
    case = CASES[name]
    per_rank = [torch.load(ep_run / f"rank{r}.pt")[name] for r in range(WORLD)]
    expected = _single_process(case)
    if case.sender:  # the output is the sender's; the other rank's is a placeholder's
        assert [t.shape[0] for t in per_rank] == [case.counts[0]] * WORLD
        assert relative_error(per_rank[0], expected) < case.tol
        return
    assert [t.shape[0] for t in per_rank] == list(case.counts)
    assert relative_error(torch.cat(per_rank), expected) < case.tol


def test_a_dead_rank_makes_the_next_forward_fail_fast(ep_run: Path) -> None:
    result = json.loads((ep_run / "dead_rank.json").read_text())
    assert result["error"] != "no error"
    assert result["seconds"] <= TIMEOUT_S + 5


def _rows(m: int, fp8_width: int) -> list[torch.Tensor]:
    return [
        torch.randn(m, fp8_width).to(torch.float8_e4m3fn),
        torch.randint(0, 9, (m, 2), dtype=torch.int32),
        torch.rand(m, 2),
        torch.rand(m, 1).bfloat16(),
    ]


def _same_bytes(unpacked: list[torch.Tensor], rows: list[torch.Tensor]) -> bool:
    return all(
        got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))
        for got, want in zip(unpacked, rows, strict=True)
    )


@pytest.mark.parametrize("m", [0, 3])
def test_packed_rows_round_trip_every_dtype_and_zero_rows(m: int) -> None:
    rows = _rows(m, fp8_width=8)
    rows[3] = rows[3].float()  # rows whose widths are multiples of 4 (each dtype's view)
    packed = pack_rows(rows)
    assert packed.shape == (m, 8 + 8 + 8 + 4)
    assert _same_bytes(unpack_rows(packed, rows), rows)


@pytest.mark.parametrize("m", [0, 3])
def test_packed_segments_round_trip_as_aligned_views_without_copies(m: int) -> None:
    rows = _rows(m, fp8_width=7)  # 21 bytes: the next segment still starts 16-byte aligned
    packed = pack_segments(rows)
    assert packed.shape == (0 if m == 0 else 32 + 32 + 32 + 16,)
    views = unpack_segments(packed, rows)
    assert _same_bytes(views, rows)
    assert all(v.is_contiguous() for v in views)  # the experts read them where they landed
    if m:
        assert [v.data_ptr() - packed.data_ptr() for v in views] == [0, 32, 64, 96]


@pytest.mark.parametrize("how", [None, *ActQuant])
def test_a_receiving_rank_holds_buffers_like_the_senders_rows(how: ActQuant | None) -> None:
    """What a rank that receives the broadcast brings must match the sender's rows in shape
    and dtype, byte for byte in size, or the collective reads past them."""
    cfg = _cfg(experts=6, top_k=2)
    hidden, routing = _inputs(Case(cfg, counts=(5, 0)))
    spec = DispatchSpec(how, cfg.num_experts)
    sent = dispatch_locally(hidden, routing, spec)
    want = [sent.hidden, sent.topk_ids, sent.topk_weights] + ([sent.scale] if how else [])
    got = received_like(torch.zeros_like(hidden), _placeholder(routing), how)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]


class _RecordingGroup:
    """A one-process stand-in for a process group: each collective logs itself (a receiver's
    rows arrive as zero bytes: expert 0, weight 0); `wait` logs which collective a rank waited
    for, in order."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self.log: list[str] = []

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return WORLD

    def broadcast(self, tensor: torch.Tensor, root: int) -> str:
        if self._rank != root:
            tensor.zero_()
        self.log.append("broadcast")
        return "broadcast"

    def reduce(self, tensor: torch.Tensor, root: int, op: object) -> str:
        self.log.append("reduce")
        return "reduce"

    def wait(self, work: str) -> None:
        self.log.append(f"wait {work}")


@pytest.mark.parametrize(
    ("rank", "order"),
    [
        (0, ["broadcast", "experts", "wait broadcast", "reduce", "wait reduce"]),
        (1, ["broadcast", "wait broadcast", "experts", "reduce", "wait reduce"]),
    ],
)
def test_the_sender_computes_while_its_rows_travel_and_receivers_wait_for_theirs(
    rank: int, order: list[str]
) -> None:
    """The sender's experts read rows it already holds, so it joins its broadcast only before
    its reduce (the reduce needs every rank's rows computed); a receiver computes nothing
    before its rows land."""
    cfg = _cfg()
    hidden, routing = _inputs(Case(cfg, counts=(5, 0)))
    group = _RecordingGroup(rank)
    stage = NaiveEP(group=group, sender=0, wait=group.wait)  # type: ignore[arg-type]
    kernel = ModularKernel(
        stage, ReferenceExperts(cfg, random_expert_weights(cfg)), Workspace(hidden.device)
    )
    experts_apply = kernel.experts.apply

    def logged_apply(*args: object, **kwargs: object) -> torch.Tensor:
        group.log.append("experts")
        return experts_apply(*args, **kwargs)

    kernel.experts.apply = logged_apply  # type: ignore[method-assign]
    kernel.forward(hidden, routing)
    assert group.log == order


@pytest.mark.parametrize(
    ("k", "blocks", "edges"),
    [(7168, 2, [0, 3584, 7168]), (7168, 4, [0, 1792, 3584, 5376, 7168]), (300, 2, [0, 256, 300]),
     (100, 2, [0, 100])],
)  # fmt: skip
def test_column_blocks_cover_the_columns_on_scale_group_edges(
    k: int, blocks: int, edges: list[int]
) -> None:
    cols = column_blocks(k, blocks)
    assert [c.start for c in cols] + [cols[-1].stop] == edges


def _triton_inputs(case: Case) -> tuple[torch.Tensor, Routing]:
    """`_inputs` where the Triton experts run: a GPU when there is one (its kernels take no host
    tensors), else the host, in Triton's interpreter."""
    hidden, routing = _inputs(case)
    if not torch.cuda.is_available():
        return hidden, routing
    cuda = torch.device("cuda")
    return hidden.to(cuda), Routing(routing.topk_ids.to(cuda), routing.topk_weights.to(cuda))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_large_sum_is_reduced_block_by_block_as_the_experts_write_it(
    rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank reduces the same blocks in the same order, each as soon as the experts wrote
    it (inside their apply); the sender's output is the one a whole reduce gives, bit for bit.
    On a GPU the experts' own graphs are off, so that each block's GEMM2 call is seen."""
    monkeypatch.setattr(triton_experts, "MAX_GRAPH_TOKENS", 0)
    cfg = _cfg(dtype=torch.float16, hidden=384)  # blocks of 256 and 128 columns
    hidden, routing = _triton_inputs(Case(cfg, counts=(6, 0)))
    experts = TritonExperts(cfg, random_expert_weights(cfg).to(hidden.device))

    gemm2 = experts._gemm2

    def forward(blocks_from_bytes: int) -> tuple[torch.Tensor, list[str]]:
        monkeypatch.setattr(naive_ep, "REDUCE_IN_BLOCKS_BYTES", blocks_from_bytes)
        group = _RecordingGroup(rank)

        def logged_gemm2(*args: object) -> None:
            group.log.append("gemm2")
            gemm2(*args)

        monkeypatch.setattr(experts, "_gemm2", logged_gemm2)
        stage = NaiveEP(group=group, sender=0, wait=group.wait)  # type: ignore[arg-type]
        out = ModularKernel(stage, experts, Workspace(hidden.device)).forward(hidden, routing)
        return out, group.log

    whole, whole_log = forward(blocks_from_bytes=1 << 40)
    blocked, log = forward(blocks_from_bytes=0)
    assert whole_log.count("reduce") == 1
    first_block = ["gemm2", "wait broadcast"] if rank == 0 else ["wait broadcast", "gemm2"]
    assert log == ["broadcast", *first_block, "reduce", "gemm2", "reduce", *["wait reduce"] * 2]
    if rank == 0:
        assert torch.equal(blocked, whole)


def test_a_forward_that_failed_midway_leaves_nothing_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The service keeps the stage after a rank dies (regroup_kernel points it at the
    survivors' group): reduces the failed forward queued are not waited for again."""
    monkeypatch.setattr(naive_ep, "REDUCE_IN_BLOCKS_BYTES", 0)
    cfg = _cfg(dtype=torch.float16, hidden=384)
    hidden, routing = _triton_inputs(Case(cfg, counts=(6, 0)))
    aborted = _RecordingGroup(0)

    def wait_then_fail(work: str) -> None:
        aborted.wait(work)
        if work == "reduce":
            raise RuntimeError("the expert-parallel group was aborted: a rank died")

    stage = NaiveEP(group=aborted, sender=0, wait=wait_then_fail)  # type: ignore[arg-type]
    experts = TritonExperts(cfg, random_expert_weights(cfg).to(hidden.device))
    kernel = ModularKernel(stage, experts, Workspace(hidden.device))
    with pytest.raises(RuntimeError, match="aborted"):
        kernel.forward(hidden, routing)
    survivors = _RecordingGroup(0)
    stage.group, stage.wait = survivors, survivors.wait  # type: ignore[assignment]
    kernel.forward(hidden, routing)
    assert survivors.log == [
        "broadcast", "wait broadcast", "reduce", "reduce", "wait reduce", "wait reduce"
    ]  # fmt: skip


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
    placement = read_placement(file, num_experts=4, world_size=2)
    assert placement.local_experts(0) == [3, 0]
    assert placement.expert_map(0).tolist() == [1, -1, -1, 0]
    assert placement.expert_map(1).tolist() == [-1, 0, 1, -1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"ranks": [[0, 1, 1], [2, 3]]}', r"rank 0 lists experts \[1\] more than once"),
        ('{"ranks": [[0], [1, 2]]}', r"missing \[3\]"),
        ('{"ranks": [[0, 1, 2, 3, 4], []]}', r"out of range \[4\]"),
        ('{"ranks": [[0, 1, 2, 3], []]}', r"ranks \[1\] would hold no experts"),
        ('{"ranks": [[0, 1, 2, 3]]}', "lists 1 ranks, the group has 2"),
        ('{"ranks": [[0, -1], [2, 3]]}', "ranks.0.1"),
        ('{"rank": [[0, 1], [2, 3]]}', "ranks: Field required"),
        ('{"ranks": [[0, 1], [2, 3]], "counts": [1, 2]}', "2 expert counts for 4 experts"),
        ("not json", "Invalid JSON"),
    ],
)
def test_bad_placement_file_is_refused_naming_the_file_and_problem(
    tmp_path: Path, text: str, message: str
) -> None:
    file = tmp_path / "placement.json"
    file.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        read_placement(file, num_experts=4, world_size=2)
    assert str(file) in str(err.value)


def test_placement_file_may_replicate_experts_and_carry_their_counts(tmp_path: Path) -> None:
    file = tmp_path / "p.json"
    file.write_text('{"ranks": [[0, 1, 3], [2, 3]], "counts": [5, 0, 1, 9]}')
    placement = read_placement(file, num_experts=4, world_size=2)
    assert placement.copies(3) == [0, 1]
    assert read_expert_counts(file, num_experts=4) == [5, 0, 1, 9]
    file.write_text('{"ranks": [[0, 1], [2, 3]]}')
    assert read_expert_counts(file, num_experts=4) is None


def test_missing_placement_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read it"):
        read_placement(tmp_path / "nope.json", num_experts=4, world_size=2)


def test_expert_parallel_selection_pairs_naive_ep_and_names_unfit_backends(
    tiny_config: MoEConfig,
) -> None:
    cpu = torch.device("cpu")
    auto = selection.select(tiny_config, cpu, expert_parallel=True)
    assert auto.experts is ReferenceExperts and auto.prepare_finalize is NaiveEP
    assert "standard format" in auto.rejected["reference-batched"]
    with pytest.raises(ValueError, match=r"reference-batched.*standard format"):
        selection.select(tiny_config, cpu, "reference-batched", expert_parallel=True)
    assert selection.select(tiny_config, cpu).prepare_finalize is NoEP


def test_build_layer_composes_a_slice_of_the_experts_with_the_given_stage(
    tiny_config: MoEConfig,
) -> None:
    cpu = torch.device("cpu")
    expert_map = contiguous_expert_map(tiny_config.num_experts, rank=1, world_size=WORLD)
    local = random_expert_weights(tiny_config, seed=2).select(torch.nonzero(expert_map >= 0)[:, 0])
    layer, choice = build_layer(
        tiny_config,
        LayerWeights(local, RouterWeights()),
        cpu,
        chunk_tokens=5,
        expert_map=expert_map,
        prepare_finalize=NoEP(),  # a stand-in for the collective: this rank's partial sums
    )
    assert (
        choice.experts is ReferenceExperts
        and "standard format" in choice.rejected["reference-batched"]
    )
    by_hand = ModularKernel(
        NoEP(), ReferenceExperts(tiny_config, local), Workspace(cpu), expert_map, chunk_tokens=5
    )
    hidden = torch.randn(13, tiny_config.hidden_size, generator=torch.Generator().manual_seed(3))
    routing = route(torch.randn(13, tiny_config.num_experts), tiny_config.routing)
    assert layer.kernel.chunk_tokens == 5
    assert torch.equal(layer.kernel.forward(hidden, routing), by_hand.forward(hidden, routing))


# ---- GPU: a DeepSeek-V3 layer over two GPUs (NCCL) against one GPU, with timings -------------
#
# Run on a host with two GPUs:
#   python3 -m pytest -q -m gpu tests/kernels/test_naive_ep.py -o log_cli=true --log-cli-level=INFO
# Both ranks draw the whole layer from the same seed on their own GPU and keep their half of the
# experts. Per backend and token count M: rank 0 alone (NoEP, all experts), then EP over 2 GPUs
# with M/2 tokens per rank ("split", equal counts), with all M on rank 0 ("rank0": sequence
# parallel, two host syncs) and in the sender mode the service runs ("sender": rank 0 brings
# all M, rank 1 a placeholder; broadcast and reduce, no host sync). Collectives are timed in
# place with CUDA events.

GPU_TOKENS = (64, 4096)
GPU_TOL = 1e-2  # EP against one GPU, same backend: only the summation order differs
GPU_ITERS = (3, 20)  # (warm-up, timed) calls
REFERENCE_ITERS = (1, 2)  # the float32 oracle is slow; its numbers are not figures


@dataclass(frozen=True)
class GpuRun:
    shape: str = "deepseek-v3"
    tokens: tuple[int, ...] = GPU_TOKENS
    backend: str = "nccl"


def _median_us(fn: Callable[[], object], device: torch.device, iters: tuple[int, int]) -> float:
    """Median time of `fn` over a fixed number of calls: each call is a collective, so every
    rank must make exactly as many (no adaptive sizing). CUDA events on the GPU."""
    warmup, timed = iters
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(timed):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)
    events = []
    for _ in range(timed):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        events.append((begin, end))
    torch.cuda.synchronize(device)
    return statistics.median(b.elapsed_time(e) * 1e3 for b, e in events)


class TimedNaiveEP(NaiveEP):
    """NaiveEP that records how long its collectives take, per forward (CUDA events or clock)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.calls: list[list[tuple[object, object]]] = []  # per forward: (start, end) marks

    def _mark(self) -> object:
        if not torch.cuda.is_available():
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _timed(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        start = self._mark()
        out = fn()
        self.calls[-1].append((start, self._mark()))
        return out

    def planned_tokens(self, hidden: torch.Tensor) -> int:
        self.calls.append([])  # the modular kernel asks this first, once per forward
        return self._timed(lambda: super(TimedNaiveEP, self).planned_tokens(hidden))

    def all_gather(self, rows: torch.Tensor) -> torch.Tensor:
        return self._timed(lambda: super(TimedNaiveEP, self).all_gather(rows))

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        return self._timed(lambda: super(TimedNaiveEP, self).reduce_scatter(partial))

    def broadcast(self, rows: torch.Tensor) -> torch.Tensor:
        return self._timed(lambda: super(TimedNaiveEP, self).broadcast(rows))

    def reduce_to_sender(self, partial: torch.Tensor) -> torch.Tensor:
        return self._timed(lambda: super(TimedNaiveEP, self).reduce_to_sender(partial))

    def comm_us(self, last: int) -> float:
        """Median over the last `last` forwards of the time spent in collectives, microseconds."""
        per_call = []
        for marks in self.calls[-last:]:
            if torch.cuda.is_available():
                per_call.append(sum(a.elapsed_time(b) * 1e3 for a, b in marks))
            else:
                per_call.append(sum((b - a) * 1e6 for a, b in marks))
        return statistics.median(per_call)


def _gpu_rank(rank: int, port: int, files: Path, run: GpuRun) -> None:
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(message)s")
    device = torch.device("cuda", rank) if run.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        run.backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    cfg = SHAPES[run.shape]
    layer = random_layer(cfg, device, seed=0)
    placement = Placement.contiguous(cfg.num_experts, WORLD)
    local = layer.experts.select(torch.tensor(placement.local_experts(rank), device=device))
    expert_map = placement.expert_map(rank).to(device)
    backends = {}  # each as a layer builds it (triton-or-deep-gemm with its rule's count)
    for name in registry.experts_backends():
        try:
            backends[name] = selection.select(cfg, device, name, expert_parallel=True).experts
        except ValueError:
            continue
    rows = []
    for m in run.tokens:
        gen = torch.Generator(device).manual_seed(m)
        hidden = torch.randn(m, cfg.hidden_size, generator=gen, device=device).to(cfg.dtype)
        logits = torch.randn(m, cfg.num_experts, generator=gen, device=device)
        routing = route(logits, cfg.routing, layer.router.correction_bias)
        for name, cls in backends.items():
            if name == "reference" and m > min(run.tokens):
                continue  # the float32 oracle: correctness at the small M is enough
            rows += _gpu_backend_rows(rank, cls, cfg, (layer, local, expert_map), hidden, routing)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # each backend may hold its own weight layout
    if rank == 0:
        (files / "gpu_rows.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _gpu_backend_rows(
    rank: int,
    cls: type[Experts],
    cfg: MoEConfig,
    weights: tuple,
    hidden: torch.Tensor,
    routing: Routing,
) -> list[dict]:
    """One backend at one M: rank 0 alone, EP split, EP rank0. Rows only on rank 0."""
    name = cls.name
    layer, local, expert_map = weights
    device, m = hidden.device, hidden.shape[0]
    iters = REFERENCE_ITERS if name == "reference" else GPU_ITERS
    rows, single = [], None
    if rank == 0:
        kernel = ModularKernel(NoEP(), cls(cfg, layer.experts), Workspace(device))
        single = kernel.forward(hidden, routing)
        us = _median_us(lambda: kernel.forward(hidden, routing), device, iters)
        rows.append({"backend": name, "M": m, "mode": "1 GPU", "us": us})
        log.info("%s", rows[-1])
    dist.barrier()
    half = slice(rank * m // WORLD, (rank + 1) * m // WORLD)
    everything = slice(0, m)
    for mode, mode_args, part in (
        ("EP2 split", {}, half),
        ("EP2 rank0", {"sequence_parallel": True}, slice(0, m * (1 - rank))),
        ("EP2 sender", {"sender": 0}, everything),
    ):
        pf = TimedNaiveEP(**mode_args)
        kernel = ModularKernel(pf, cls(cfg, local), Workspace(device), expert_map=expert_map)
        mine = Routing(routing.topk_ids[part], routing.topk_weights[part])
        if rank != 0 and "sender" in mode_args:  # placeholders: the rows come from rank 0
            mine = Routing(torch.zeros_like(mine.topk_ids), torch.zeros_like(mine.topk_weights))
        out = kernel.forward(hidden[part], mine)
        if not mode_args:
            full = out.new_empty((m, out.shape[1]))
            dist.all_gather_into_tensor(full, out.contiguous())
            out = full
        us = _median_us(lambda k=kernel, h=hidden[part], r=mine: k.forward(h, r), device, iters)
        comm = pf.comm_us(iters[1])
        if rank == 0:
            rows.append(
                {
                    "backend": name,
                    "M": m,
                    "mode": mode,
                    "us": us,
                    "comm_us": comm,
                    "rel_err": relative_error(out, single),
                }
            )
            log.info("%s", rows[-1])
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["backend | M | mode | forward us | comm us | comm share | rel err vs 1 GPU"]
    for r in rows:
        comm = r.get("comm_us")
        share = "" if comm is None else f"{comm / r['us']:.0%}"
        comm_text = "" if comm is None else f"{comm:.0f}"
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        cells = [r["backend"], r["M"], r["mode"], f"{r['us']:.0f}", comm_text, share, err]
        lines.append(" | ".join(map(str, cells)))
    return "\n".join(lines)


def _run_two_ranks(run: GpuRun, files: Path, timeout_s: float) -> list[dict]:
    run_ranks(_gpu_rank, (files, run), WORLD, timeout_s)
    return json.loads((files / "gpu_rows.json").read_text())


@pytest.mark.gpu
def test_deepseek_v3_over_two_gpus_matches_one_gpu_for_every_expert_map_backend(
    tmp_path: Path,
) -> None:
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[name] = "0" if name == "NCCL_NVLS_ENABLE" else "1"  # KINDS.md: keep these set
    rows = _run_two_ranks(GpuRun(), tmp_path, timeout_s=480)
    log.info("DeepSeek-V3 layer (%s):\n%s", torch.cuda.get_device_name(0), _table(rows))
    log.info("rows: %s", json.dumps(rows))
    bad = [r for r in rows if r.get("rel_err", 0.0) >= GPU_TOL]
    assert not bad, f"EP differs from one GPU: {bad}"
    assert {r["mode"] for r in rows} == {"1 GPU", "EP2 split", "EP2 rank0", "EP2 sender"}
