"""The Triton experts on tiny shapes (fp16 / fp32 / fp8) against the reference backend, plus the
align step and tile selection. On a CPU the kernels run in Triton's interpreter
(kernels/experts/_triton/__init__.py turns it on); with a GPU, compiled on it.

bf16 runs on the GPU only (tests/kernels/test_triton_gpu.py): the interpreter's bf16 dot is wrong.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import triton
import triton.language as tl

from moe_serve.kernels.accuracy import relative_error, tolerance
from moe_serve.kernels.config import Activation, GateUp
from moe_serve.kernels.experts._triton import tiles
from moe_serve.kernels.experts._triton.align import align_pairs, align_pairs_torch, aligned_capacity
from moe_serve.kernels.experts._triton.gemv import MAX_PAIRS, EachPair, SlotSum, pair_gemv
from moe_serve.kernels.experts._triton.graphs import MAX_GRAPH_TOKENS
from moe_serve.kernels.experts._triton.grouped_gemm import (
    Activations,
    Epilogue,
    ExpertMatrix,
    GemmTile,
    _e2m1_to_float,
    grouped_gemm,
)
from moe_serve.kernels.experts._triton.quantize import quantize_into
from moe_serve.kernels.experts._triton.topk_sum import topk_sum
from moe_serve.kernels.experts.deep_gemm import DeepGemmExperts
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.experts.token_switch import TritonOrDeepGemmExperts
from moe_serve.kernels.experts.triton import TritonBatchedExperts, TritonExperts
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.prepare_finalize.naive_ep import column_blocks
from moe_serve.kernels.prepare_finalize.no_ep import NoEP
from moe_serve.kernels.quant_scheme import FP8, ActQuant, QuantConfig, QuantScheme
from moe_serve.kernels.quantize import E2M1_VALUES, dequantize_mxfp4, quantize_activation
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.routing import contiguous_expert_map
from moe_serve.kernels.stages import ColumnBlocks, DispatchSpec, SideOutput, SumTarget
from moe_serve.kernels.tensors import Format
from moe_serve.kernels.workspace import Workspace
from tests.kernels.triton_cases import (
    ALL_SCHEMES,
    Case,
    random_routing,
    run_triton,
    triton_vs_reference,
)

CPU = torch.device("cpu")  # selection and align; the kernels run on the `device` fixture
FORMATS = (Format.STANDARD, Format.BATCHED)


# ---- align ---------------------------------------------------------------------------------


def _runs(topk_ids: torch.Tensor, num_experts: int) -> dict[int, list[int]]:
    """What the align step must produce: expert -> its pair ids, ascending (the large-input
    path places them in any order within the run)."""
    runs: dict[int, list[int]] = {}
    for pair, e in enumerate(topk_ids.flatten().tolist()):
        if e >= 0:
            runs.setdefault(e, []).append(pair)
    return runs


@pytest.mark.parametrize("align", [align_pairs, align_pairs_torch])
@pytest.mark.parametrize(("m", "block_m"), [(1, 16), (7, 16), (50, 32), (333, 64), (3000, 64)])
def test_align_groups_every_local_pair_into_padded_runs_of_its_expert(
    m: int, block_m: int, align: object, device: torch.device
) -> None:
    num_experts, k = 6, 3
    ids = random_routing(m, num_experts, k, seed=m).topk_ids
    ids[ids == 2] = -1  # an expert on another rank
    aligned = align(ids.to(device), num_experts, block_m)
    aligned = type(aligned)(aligned.row_ids.cpu(), aligned.block_expert.cpu(), m * k, block_m)
    rows = aligned.row_ids.view(-1, block_m)
    assert rows.shape[0] == aligned.num_blocks
    assert aligned.row_ids.numel() == aligned_capacity(m * k, num_experts, block_m)
    found: dict[int, list[int]] = {}
    for block, e in enumerate(aligned.block_expert.tolist()):
        pairs = [p for p in rows[block].tolist() if p < m * k]
        if e < 0:
            assert not pairs, "a block without an expert holds pairs"
            continue
        found.setdefault(e, []).extend(pairs)
        assert all(ids.flatten()[p] == e for p in pairs)
    assert {e: sorted(p) for e, p in found.items()} == _runs(ids, num_experts)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(
    ("m", "num_experts", "k"),
    [(1, 128, 8), (1, 256, 8), (7, 8, 2), (12, 64, 4), (64, 8, 2), (16, 256, 8), (5, 4, 4)],
)
def test_fused_align_kernel_equals_the_torch_align(
    m: int, num_experts: int, k: int, block_m: int, device: torch.device
) -> None:
    ids = random_routing(m, num_experts, k, seed=m).topk_ids
    ids[ids == 3] = -1
    ids = ids.to(device)
    fused = align_pairs(ids, num_experts, block_m)  # up to 128 pairs: the one-launch kernel
    plain = align_pairs_torch(ids, num_experts, block_m)
    assert torch.equal(fused.row_ids, plain.row_ids)
    assert torch.equal(fused.block_expert, plain.block_expert)


def test_align_gives_no_block_to_an_expert_without_pairs(device: torch.device) -> None:
    ids = torch.tensor([[0, 3], [3, 0], [0, 3]], dtype=torch.int32, device=device)
    aligned = align_pairs(ids, num_experts=5, block_m=16)
    used = aligned.block_expert[aligned.block_expert >= 0].tolist()
    assert used == [0, 3]


def test_align_of_pairs_all_on_other_ranks_leaves_every_block_unused(device: torch.device) -> None:
    ids = torch.full((4, 2), -1, dtype=torch.int32, device=device)
    aligned = align_pairs(ids, num_experts=3, block_m=16)
    assert (aligned.block_expert == -1).all()
    assert (aligned.row_ids == 8).all()


# ---- the experts against the reference -------------------------------------------------------


def _schemes_taking_turns() -> list[tuple[int, QuantScheme, Activation, GateUp]]:
    """Every scheme with its index, the activations and their layouts taking turns."""
    kinds = [(Activation.SILU, GateUp.SPLIT), (Activation.GELU, GateUp.SPLIT),
             (Activation.SWIGLUOAI, GateUp.INTERLEAVED)]  # fmt: skip
    return [(i, scheme, *kinds[i % 3]) for i, scheme in enumerate(ALL_SCHEMES)]


def _scheme_cases() -> list:
    """Every scheme in both formats, alternating fp16 / fp32 and the activations."""
    params = []
    for i, scheme, activation, layout in _schemes_taking_turns():
        dtype = torch.float16 if i % 2 else torch.float32
        case = Case(scheme, dtype, activation, layout, has_bias=activation == Activation.SWIGLUOAI)
        for fmt in FORMATS:
            name = f"{scheme}-{str(dtype)[6:]}-{activation}-{fmt}"
            params.append(pytest.param(case, fmt, id=name))
    return params


@pytest.mark.parametrize(("case", "fmt"), _scheme_cases())
def test_triton_matches_reference_for_every_scheme_and_format(
    case: Case, fmt: Format, device: torch.device
) -> None:
    cfg = case.config()
    routing = random_routing(9, cfg.num_experts, cfg.top_k, seed=1)
    err = triton_vs_reference(cfg, routing, device, fmt)
    assert err < tolerance(cfg)


@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("layout", list(GateUp))
def test_fused_activation_matches_reference_for_each_gate_up_layout_with_bias(
    activation: Activation, layout: GateUp, device: torch.device
) -> None:
    cfg = Case(activation=activation, gate_up=layout, has_bias=True).config()
    err = triton_vs_reference(cfg, random_routing(5, 4, 2, seed=3), device)
    assert err < tolerance(cfg)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "scheme", [QuantScheme.NONE, QuantScheme.FP8_BLOCK, QuantScheme.INT4_W4A16]
)
def test_single_token_matches_reference(
    fmt: Format, scheme: QuantScheme, device: torch.device
) -> None:
    cfg = Case(scheme).config()
    assert triton_vs_reference(cfg, random_routing(1, 4, 2, seed=4), device, fmt) < tolerance(cfg)


@pytest.mark.parametrize("block_k", [32, 128])
@pytest.mark.parametrize("scheme", [QuantScheme.INT4_W4A16, QuantScheme.MXFP4])
def test_packed_weights_match_reference_with_k_tiles_inside_and_across_scale_groups(
    scheme: QuantScheme, block_k: int, device: torch.device
) -> None:
    cfg = Case(scheme, intermediate=128, group_size=64).config()  # mxfp4 groups are 32 anyway
    tile = GemmTile(32, block_k, 4, 2)
    fixed = tiles.LayerTiles(16, tile, tile)
    err = triton_vs_reference(cfg, random_routing(6, 4, 2, seed=7), device, tiles=fixed)
    assert err < tolerance(cfg)


def test_int4_groups_that_do_not_nest_with_k_tiles_are_refused_with_the_reason() -> None:
    cfg = Case(QuantScheme.INT4_W4A16, group_size=24, hidden=48, intermediate=96).config()
    support = TritonExperts.check_config(cfg)
    assert not support and "group_size 24" in support.reason


@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_TENSOR])
def test_a_large_batch_takes_the_three_launch_align_and_matches_reference(
    scheme: QuantScheme, device: torch.device
) -> None:
    cfg = Case(scheme).config()
    # 1200 pairs: past the one-program align (128 pairs), two programs in each of its launches
    # (1024 pairs or 1024 rows a program, the second partial)
    routing = random_routing(600, 4, 2, seed=8)
    assert triton_vs_reference(cfg, routing, device) < tolerance(cfg)


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_tokens_on_one_expert_and_empty_experts_match_reference(
    fmt: Format, device: torch.device
) -> None:
    cfg = Case(num_experts=8, top_k=2).config()
    routing = random_routing(40, 8, 2, seed=5, only=6)  # 6 takes all 40; some others none
    assert triton_vs_reference(cfg, routing, device, fmt) < tolerance(cfg)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_TENSOR])
def test_expert_map_skips_pairs_of_experts_on_other_ranks(
    fmt: Format, scheme: QuantScheme, device: torch.device
) -> None:
    cfg = Case(scheme, num_experts=6, top_k=3).config()
    expert_map = contiguous_expert_map(6, rank=1, world_size=2)  # experts 3..5 here, 0..2 -1
    routing = random_routing(11, 6, 3, seed=6)
    assert triton_vs_reference(cfg, routing, device, fmt, expert_map) < tolerance(cfg)


def test_repeated_forwards_reuse_the_workspace(device: torch.device) -> None:
    cfg = Case().config()
    ws = Workspace(device)
    experts = TritonExperts(cfg, random_expert_weights(cfg).to(device))
    kernel = ModularKernel(NoEP(), experts, ws, chunk_tokens=16)
    allocated = ws.allocations
    for m in (16, 3, 40):  # 40: three chunks of at most 16
        r = random_routing(m, 4, 2, seed=m)
        routing = type(r)(r.topk_ids.to(device), r.topk_weights.to(device))
        kernel.forward(torch.randn(m, 64, device=device).half(), routing)
    assert ws.allocations == allocated


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])  # float32: an EP partial
def test_shared_output_joins_the_top_k_sum_before_its_one_rounding(
    out_dtype: torch.dtype, device: torch.device
) -> None:
    """The shared experts' float32 output is added in the top-k sum's own pass, whether the
    sum is the layer's output or a float32 partial sum: equal to the reference's sum plus it,
    rounded once, as the finalize of experts that leave the sum to it writes it."""
    cfg = Case(num_experts=8, top_k=3).config()
    weights = random_expert_weights(cfg, seed=2).to(device)
    m = 13
    r = random_routing(m, 8, 3, seed=9)
    r.topk_ids[2, 1] = -1  # a pair of another rank's expert
    routing = type(r)(r.topk_ids.to(device), r.topk_weights.to(device))
    hidden = torch.randn(m, 64, generator=torch.Generator().manual_seed(1)).half().to(device)
    extra = torch.randn(m, 64, generator=torch.Generator().manual_seed(3)).to(device) * 4

    def forward(experts_cls: type) -> torch.Tensor:
        kernel = ModularKernel(NoEP(), experts_cls(cfg, weights), Workspace(device))
        out = torch.empty(m, 64, dtype=out_dtype, device=device)
        return kernel.forward(hidden, routing, out=out, shared=lambda: SideOutput(extra))

    got, want = forward(TritonExperts), forward(ReferenceExperts)
    assert got.dtype == out_dtype
    assert relative_error(got.float(), want.float()) < tolerance(cfg)
    without = ModularKernel(NoEP(), TritonExperts(cfg, weights), Workspace(device)).forward(
        hidden, routing, out=torch.empty(m, 64, dtype=out_dtype, device=device)
    )
    assert torch.equal(got, (without.float() + extra).to(out_dtype)) == (out_dtype == torch.float32)


# 133: past the decode graphs, the blocks' own path; per pair a few tokens stand for the small
# batches it serves (the interpreter runs a program a token and column tile, so the tiles here
# are 64 columns wide: the block of 256 takes four, the one of 128 two, GEMM1's 96 one and a half)
WIDE_PER_PAIR = tiles.LayerTiles(16, GemmTile(64, 64, 4, 2), GemmTile(64, 128, 4, 1), per_pair=True)


@pytest.mark.parametrize(
    ("m", "per_pair"),
    [(9, False), (133, False), (3, True), (133, True)],
    ids=["9-grouped", "133-grouped", "3-per-pair", "133-per-pair"],
)
@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_a_sum_in_column_blocks_equals_the_whole_sum_bit_for_bit(
    scheme: QuantScheme, m: int, per_pair: bool, device: torch.device
) -> None:
    """GEMM2 and the top-k sum block by block (naive-ep reduces a block while the next one
    computes): every element as the whole sum has it, the shared output included, and each
    block complete, in order, when it is handed on. 384 columns: blocks of 256 and 128, each
    on fp8-block's 128-row scale groups. Per pair, GEMM2 sums each block as it writes it."""
    if device.type == "cpu" and m > MAX_GRAPH_TOKENS:
        pytest.skip("no decode graphs on the CPU: a smaller m takes the same path")
    cfg = Case(scheme, num_experts=8, top_k=3, hidden=384).config()
    fixed = WIDE_PER_PAIR if per_pair else None
    experts = TritonExperts(cfg, random_expert_weights(cfg, seed=5).to(device), fixed)
    r = random_routing(m, 8, 3, seed=m)
    r.topk_ids[0, 1] = -1  # a pair of another rank's expert
    routing = type(r)(r.topk_ids.to(device), r.topk_weights.to(device))
    gen = torch.Generator().manual_seed(m)
    hidden = torch.randn(m, 384, generator=gen).half().to(device)
    extra = SideOutput(torch.randn(m, 384, generator=gen).to(device))
    ws = Workspace(device)
    x = NoEP().prepare(hidden, routing, DispatchSpec(experts.act_quant(), 8), ws)
    whole = experts.apply(x, ws, SumTarget(torch.empty(m, 384, device=device), extra)).clone()

    cols = column_blocks(384, 2)
    assert [(c.start, c.stop) for c in cols] == [(0, 256), (256, 384)]
    parts = tuple(torch.full((m, c.stop - c.start), torch.nan, device=device) for c in cols)
    handed: list[tuple[int, torch.Tensor]] = []
    blocks = ColumnBlocks(parts, lambda b: handed.append((b, parts[b].clone())))
    assert experts.apply(x, ws, SumTarget(blocks, extra)) is blocks
    assert [b for b, _ in handed] == [0, 1]
    assert torch.equal(torch.cat([part for _, part in handed], dim=1), whole)


# ---- selection and tiles -------------------------------------------------------------------


@pytest.mark.parametrize("cls", [TritonExperts, TritonBatchedExperts])
def test_triton_backends_are_not_offered_without_a_cuda_gpu(cls: type) -> None:
    support = cls.supports(Case().config(), CPU)
    assert not support and "cuda" in support.reason


def test_heuristic_uses_small_row_tiles_for_decode_and_large_for_prefill() -> None:
    cfg = Case(num_experts=8, top_k=2).config()
    assert tiles.heuristic_tiles(cfg, 1, per_pair=False).block_m == 16
    assert tiles.heuristic_tiles(cfg, 8192).block_m == 128


def test_heuristic_block_k_divides_the_fp8_weight_block() -> None:
    cfg = Case(QuantScheme.FP8_BLOCK).config()
    for m in (1, 64, 4096):
        assert 128 % tiles.heuristic_tiles(cfg, m).gemm1.block_k == 0


def test_tuned_file_wins_over_the_heuristic_within_twice_the_nearest_bucket(
    tmp_path, monkeypatch
) -> None:
    cfg = Case().config()
    small = tiles.LayerTiles(16, GemmTile(32, 64, 2, 2), GemmTile(32, 32, 2, 3))
    large = tiles.LayerTiles(64, GemmTile(64, 32, 4, 3), GemmTile(128, 64, 8, 4))
    name = tiles.TileKey.of(cfg, "cpu").filename()
    body = {"buckets": {"1": small.to_json(), "1024": large.to_json()}}
    (tmp_path / name).write_text(json.dumps(body))
    monkeypatch.setattr(tiles, "TUNED_DIR", tmp_path)
    tiles._tuned_table.cache_clear()
    try:
        assert tiles.tiles_for(cfg, 2, CPU) == small
        assert tiles.tiles_for(cfg, 900, CPU) == large
        assert tiles.tiles_for(cfg, 64, CPU) == tiles.heuristic_tiles(cfg, 64)  # no bucket near
    finally:
        tiles._tuned_table.cache_clear()


def test_shipped_tuned_files_parse_and_each_bucket_says_what_measured_it() -> None:
    for path in tiles.TUNED_DIR.glob("E*_H*_I*.json"):  # tile files; the directory holds others
        table = tiles._tuned_table(path.name)
        assert table, f"{path.name} has no buckets"
        body = json.loads(path.read_text())
        assert set(body) == {"key", "search", "buckets"}, path.name
        assert body["key"]["device_name"].startswith("NVIDIA"), path.name
        for m, entry in body["buckets"].items():
            assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", entry["commit"]), (path.name, m)
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry["date"]), (path.name, m)
            assert entry["command"], (path.name, m)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_BLOCK])
def test_every_program_order_computes_the_same_bits(
    scheme: QuantScheme, fmt: Format, device: torch.device
) -> None:
    """Row blocks first (group_m 0) or swizzled in groups that divide the blocks or not: each
    program computes its own tile, so the order changes nothing but speed."""
    cfg = Case(scheme, torch.float16, num_experts=8, hidden=128, intermediate=160).config()
    routing = random_routing(37, cfg.num_experts, cfg.top_k, seed=5, only=3)
    outs = []
    # groups of 3 leave a partial last group of the 13 row blocks (standard) and divide the 24
    # (batched); a group of more than either maps the programs as group_m 0 does
    for group_m in (0, 3):
        tile = GemmTile(64, 64, 4, 2, group_m)
        outs.append(run_triton(cfg, routing, device, fmt, tiles.LayerTiles(16, tile, tile)))
    assert torch.equal(outs[0], outs[1])
    assert triton_vs_reference(cfg, routing, device, fmt) < tolerance(cfg)


@triton.jit
def _decode_e2m1_kernel(codes_ptr, out_ptr):
    offs = tl.arange(0, 16)
    tl.store(out_ptr + offs, _e2m1_to_float(tl.load(codes_ptr + offs)))


def test_e2m1_decoder_gives_every_code_its_value_and_sign(device: torch.device) -> None:
    """Through fp16 bits: code 1 (0.5) is an fp16 subnormal, code 8 a negative zero."""
    out = torch.empty(16, device=device)
    _decode_e2m1_kernel[(1,)](torch.arange(16, dtype=torch.uint8, device=device), out)
    out = out.cpu()
    want = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)])
    assert torch.equal(out, want)
    assert torch.equal(torch.signbit(out), torch.arange(16) >= 8)


# ---- per-pair GEMVs (decode) ---------------------------------------------------------------

PER_PAIR = tiles.LayerTiles(16, GemmTile(32, 64, 4, 2), GemmTile(16, 128, 2, 1), per_pair=True)


def _per_pair_cases() -> list:
    """Every scheme once per token count, the activations and layouts taking turns."""
    params = []
    for i, scheme, activation, layout in _schemes_taking_turns():
        case = Case(scheme, torch.float16, activation, layout, has_bias=i % 2 == 1)
        for m in (1, 5):
            params.append(pytest.param(case, m, id=f"{scheme}-{activation}-M{m}"))
    return params


@pytest.mark.parametrize(("case", "m"), _per_pair_cases())
def test_per_pair_gemvs_match_reference_for_every_scheme(
    case: Case, m: int, device: torch.device
) -> None:
    cfg = case.config()
    routing = random_routing(m, cfg.num_experts, cfg.top_k, seed=m)
    assert triton_vs_reference(cfg, routing, device, tiles=PER_PAIR) < tolerance(cfg)


# (tokens, hidden, block_n, slots of another rank's expert, all on expert 2, extra, bias): H 160,
# a multiple of the packed schemes' 32-column groups, not of the 64-column tiles (nor of
# fp8-block's 128-row scale blocks)
_SUM_CASES = {
    "M1": (1, 64, 16, (), False, False, False),
    "M2-remote-extra-bias": (2, 160, 64, ((1, 1), (1, 3)), False, True, True),
    "one-expert-extra": (3, 160, 64, (), True, True, False),
    "all-remote": (2, 96, 16, ((0, 0), (0, 1), (0, 2), (0, 3)), False, True, True),
}
_SUMMED_SCHEMES = (QuantScheme.NONE, QuantScheme.FP8_BLOCK, QuantScheme.MXFP4,
                   QuantScheme.INT4_W4A16)  # fmt: skip


def _summing_cases() -> list:
    """Each case for dense, fp8-block, mxfp4 and int4 weights into a float32 sum, and the case
    with remote slots, extra and bias into a 16-bit one (the one rounding) too; the other
    schemes' scales (per tensor, per channel, per token) on that case, both outputs."""
    name = "M2-remote-extra-bias"
    others = [s for s in ALL_SCHEMES if s not in _SUMMED_SCHEMES]
    cases = [(scheme, case, torch.float32) for scheme in _SUMMED_SCHEMES for case in _SUM_CASES]
    cases += [(scheme, name, torch.float16) for scheme in _SUMMED_SCHEMES]
    cases += [(scheme, name, out) for scheme in others for out in (torch.float32, torch.float16)]
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}-{str(c[2]).removeprefix('torch.')}") for c in cases]


@pytest.mark.parametrize(("scheme", "case", "out_dtype"), _summing_cases())
def test_summing_gemv_equals_the_pair_gemvs_then_the_top_k_sum(
    scheme: QuantScheme, case: str, out_dtype: torch.dtype, device: torch.device
) -> None:
    """GEMM2 that sums each token's slots as it writes (one program a token) against GEMM2 a
    pair at a time into float32 rows and then topk_sum: equal up to float32 summation order.
    The rows of A of another rank's pairs hold NaN (GEMM1 leaves them unwritten): never read.
    A token of such pairs alone is its extra."""
    m, hidden, block_n, remote, one_expert, has_extra, has_bias = _SUM_CASES[case]
    top_k = 4
    cfg = Case(scheme, num_experts=4, hidden=hidden, top_k=top_k, has_bias=has_bias).config()
    weights = random_expert_weights(cfg, seed=3)
    w2 = ExpertMatrix(weights.w2, weights.w2_scale, weights.w2_bias, cfg.quant)
    w2 = ExpertMatrix(*(None if t is None else t.to(device) for t in (w2.data, w2.scale, w2.bias)),
                      cfg.quant)  # fmt: skip
    g = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(4, generator=g) for _ in range(m)]).to(torch.int32)
    if one_expert:
        ids[:] = 2
    for t, slot in remote:
        ids[t, slot] = -1
    pairs = m * top_k
    here = ids.flatten() >= 0
    h = torch.randn(pairs, cfg.intermediate_size, generator=g)
    how = cfg.quant.spec.act_quant
    if how is None:
        h = h.to(cfg.dtype)
        h[~here] = torch.nan
        a = Activations(h.to(device))
    else:
        q, scale = quantize_activation(h, how)
        q.view(torch.uint8)[~here] = 0x7F  # e4m3's NaN
        if scale.dim() == 2:
            scale[~here] = torch.nan
        a = Activations(q.to(device), scale.to(device), how)
    row_weights = (torch.rand(pairs, generator=g) + 0.1).to(device)
    extra = (torch.randn(m, hidden, generator=g) * 4).to(device) if has_extra else None
    ids, epilogue = ids.to(device), Epilogue(row_weights=row_weights)
    tile = GemmTile(block_n, 64, 2, 1)
    rows = EachPair(ids.flatten())

    got = torch.full((m, hidden), torch.nan, dtype=out_dtype, device=device)
    pair_gemv(a, w2, got, rows, epilogue, tile, SlotSum(top_k, extra))
    y = torch.full((pairs, hidden), torch.nan, device=device)
    pair_gemv(a, w2, y, rows, epilogue, tile)
    want = topk_sum(y, ids, torch.empty(m, hidden, dtype=out_dtype, device=device), extra)
    got, want = got.float().cpu(), want.float().cpu()
    assert not got.isnan().any()
    if out_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:  # one rounding each: at most an ulp apart
        assert ((got - want).abs() <= torch.finfo(out_dtype).eps * want.abs()).all()
    if case == "all-remote":
        assert torch.equal(got[0], (extra[0].cpu()).to(out_dtype).float())


@pytest.mark.parametrize(
    ("scheme", "dtype", "block_k"),
    [
        (QuantScheme.NONE, torch.float32, 16),  # 4 values a 16-byte chunk, 4 chunks a step
        (QuantScheme.NONE, torch.float32, 64),  # K = 96: a masked half step
        (QuantScheme.NONE, torch.float16, 8),  # a step of one chunk
        (QuantScheme.FP8_TOKEN, torch.float16, 16),  # 16 fp8 bytes: one chunk
    ],
)
def test_per_pair_gemvs_sum_k_steps_of_one_chunk_or_several(
    scheme: QuantScheme, dtype: torch.dtype, block_k: int, device: torch.device
) -> None:
    """`_row_sums` splits each row's K step into 16-byte chunks a thread sums alone: steps of
    one chunk and of several, for 4-, 2- and 1-byte weights (GEMM2's K = 96 leaves a masked
    half step of 64)."""
    cfg = Case(scheme, dtype).config()
    tile = GemmTile(16, block_k, 2, 1)
    fixed = tiles.LayerTiles(16, tile, tile, per_pair=True)
    routing = random_routing(3, cfg.num_experts, cfg.top_k, seed=7)
    assert triton_vs_reference(cfg, routing, device, tiles=fixed) < tolerance(cfg)


@pytest.mark.parametrize(
    ("dtype", "block_k", "far"),
    [(torch.float16, 128, 14), (torch.bfloat16, 64, 40), (torch.float32, 128, 60)],
)
def test_mxfp4_per_pair_gemv_recovers_every_byte_times_its_scale_exactly(
    dtype: torch.dtype, block_k: int, far: int, device: torch.device
) -> None:
    """Each pair's activation row is one-hot at a K column, with a power of two far from 1 both
    ways (2**-far, 2**far), so each output column is one dequantised weight times it: every
    byte value, both nibbles, every e8m0 scale from 2**-27 to 2**22, and K one full K step and
    a masked last one of a scale group (the masked step holds real bytes too). A program a pair
    (K of them) and one N tile of all the rows: the interpreter runs programs one by one, so
    the bytes and scales spread over rows rather than along K."""
    rows, k = 32, block_k + 32
    g = torch.Generator().manual_seed(3)
    body = torch.randperm(rows * (k // 2 - 1), generator=g) % 256  # each byte value >= 5 times
    packed = torch.cat([body.view(rows, -1), 255 - torch.arange(rows)[:, None]], dim=1)
    packed = packed.to(torch.uint8)
    scale = (torch.randperm(rows * k // 32, generator=g) % 50 + 100).to(torch.uint8)
    scale = scale.view(rows, k // 32)  # each of 2**-27 .. 2**22 at least once
    w = ExpertMatrix(packed[None].to(device), scale[None].to(device), None,
                     QuantConfig(QuantScheme.MXFP4))  # fmt: skip
    hot = torch.tensor([2.0**-far, 2.0**far]).repeat(k // 2)
    out = torch.empty(k, rows, device=device)  # pair j reads activation row j: one-hot at j
    a = Activations(torch.diag(hot).to(dtype).to(device))
    pair_gemv(a, w, out, EachPair(torch.zeros(k, dtype=torch.int32, device=device)), Epilogue(),
              GemmTile(rows, block_k, 2, 1))  # fmt: skip
    assert torch.equal(out.cpu(), dequantize_mxfp4(packed, scale).T * hot[:, None])


@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_BLOCK])
def test_per_pair_gemvs_skip_other_ranks_pairs_and_take_one_expert_for_every_token(
    scheme: QuantScheme, device: torch.device
) -> None:
    cfg = Case(scheme, num_experts=6, top_k=3).config()
    expert_map = contiguous_expert_map(6, rank=1, world_size=2)  # experts 3..5 here
    routing = random_routing(7, 6, 3, seed=6, only=4)
    err = triton_vs_reference(cfg, routing, device, expert_map=expert_map, tiles=PER_PAIR)
    assert err < tolerance(cfg)


@pytest.mark.parametrize("block_k", [256, 1024])
@pytest.mark.parametrize("layout", list(GateUp))
def test_per_pair_fp8_block_tiles_wider_than_a_scale_block(
    layout: GateUp, block_k: int, device: torch.device
) -> None:
    """256 rows would straddle two 128 x 128 scale blocks: pair_gemv narrows the column tile to
    one block; a K step of several blocks (and PARTIAL's partial last ones) scales each column
    by its own block's scale."""
    activation = Activation.SWIGLUOAI if layout == GateUp.INTERLEAVED else Activation.SILU
    cfg = Case(QuantScheme.FP8_BLOCK, torch.float16, activation, layout, **PARTIAL).config()
    wide = GemmTile(256, block_k, 4, 1)
    fixed = tiles.LayerTiles(16, wide, wide, per_pair=True)
    err = triton_vs_reference(cfg, random_routing(3, 4, 2, seed=2), device, tiles=fixed)
    assert err < tolerance(cfg)


def test_heuristic_runs_per_pair_only_where_experts_see_a_fraction_of_a_row() -> None:
    cfg = Case(num_experts=256, top_k=8).config()  # DeepSeek-V3's routing
    assert tiles.heuristic_tiles(cfg, 1).per_pair
    assert tiles.heuristic_tiles(cfg, 8).per_pair  # 64 pairs on 256 experts
    assert not tiles.heuristic_tiles(cfg, 9).per_pair
    assert not tiles.heuristic_tiles(cfg, 1, per_pair=False).per_pair


def test_batched_format_batch_invariance_and_huge_batches_never_run_per_pair() -> None:
    cfg = Case(num_experts=256, top_k=8).config()
    weights = random_expert_weights(cfg)
    assert TritonExperts(cfg, weights).tiles(1, CPU).per_pair
    assert not TritonBatchedExperts(cfg, weights).tiles(1, CPU).per_pair
    assert not TritonExperts(cfg, weights, batch_invariant=True).tiles(1, CPU).per_pair
    wide = Case(num_experts=1 << 20, top_k=8).config()  # 0.06 pairs per expert at 8192 tokens
    assert tiles.heuristic_tiles(wide, 8192).per_pair
    # 65536 pairs, one more than the grid holds (tiles() reads the config alone: any weights do)
    assert not TritonExperts(wide, weights).tiles(8192, CPU).per_pair


def test_per_pair_gemvs_refuse_more_pairs_than_the_grid_holds() -> None:
    cfg = Case().config()
    w = ExpertMatrix(torch.zeros(4, 8, 16), None, None, cfg.quant)
    a = Activations(torch.zeros(1, 16))
    ids = torch.zeros(MAX_PAIRS + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"at most {MAX_PAIRS} pairs"):
        pair_gemv(a, w, torch.zeros(MAX_PAIRS + 1, 8), EachPair(ids), Epilogue(), PER_PAIR.gemm1)


@pytest.mark.parametrize("per_pair", [False, True], ids=["grouped", "per-pair"])
def test_gemm1_amax_covers_the_values_it_writes_and_no_padding_row(
    device: torch.device, per_pair: bool
) -> None:
    """fp8-tensor's intermediate scale comes from GEMM1's epilogue: the largest |value| of the
    rows it writes. Padding rows of an aligned block (A masked to 0) would give silu(1) * 1 from
    the bias here, the written rows about 1e-12 (every input -1 against all-ones weights); the
    pairs of another rank's expert (-1) are not computed, and their rows keep what they held."""
    experts, hidden, inter = 4, 32, 40
    cfg = Case(num_experts=experts, hidden=hidden, intermediate=inter, has_bias=True).config()
    ones = torch.ones(experts, 2 * inter, hidden, device=device)
    w = ExpertMatrix(ones, None, torch.ones(experts, 2 * inter, device=device), cfg.quant)
    ids = torch.tensor([[0, 3], [1, -1], [-1, 0]], dtype=torch.int32, device=device)
    a = Activations(torch.full((3, hidden), -1.0, device=device), pairs_per_row=2)
    h = torch.full((6, inter), float("nan"), device=device)
    amax = torch.zeros(1, device=device)
    rows = EachPair(ids.flatten()) if per_pair else align_pairs(ids, experts, 16)
    gemm = pair_gemv if per_pair else grouped_gemm
    gemm(a, w, h, rows, Epilogue(gate_up=cfg.activation, amax=amax), GemmTile(16, 32, 2, 1))
    written = (ids.flatten() >= 0).cpu()
    h, amax = h.cpu(), amax.cpu()
    assert h[~written].isnan().all() and not h[written].isnan().any()
    assert 0 < amax.item() < 1e-9
    assert amax.item() == h[written].abs().max().item()


def test_a_per_pair_tuned_entry_is_kept_from_formats_that_cannot_run_it(
    tmp_path, monkeypatch
) -> None:
    cfg = Case().config()
    name = tiles.TileKey.of(cfg, "cpu").filename()
    (tmp_path / name).write_text(json.dumps({"buckets": {"1": PER_PAIR.to_json()}}))
    monkeypatch.setattr(tiles, "TUNED_DIR", tmp_path)
    tiles._tuned_table.cache_clear()
    try:
        assert tiles.tiles_for(cfg, 1, CPU) == PER_PAIR
        assert tiles.tiles_for(cfg, 1, CPU, per_pair=False) == tiles.heuristic_tiles(cfg, 1, False)
    finally:
        tiles._tuned_table.cache_clear()


# ---- fp8-block with partial last blocks (H, I not multiples of 128) -------------------------

PARTIAL = {"hidden": 200, "intermediate": 328}  # 1 full + 72 columns, 2 full + 72 rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", list(GateUp))
@pytest.mark.parametrize(("m", "only"), [(1, None), (9, None), (33, 2)], ids=["M1", "M9", "one"])
def test_fp8_block_with_partial_last_blocks_matches_reference(
    fmt: Format, layout: GateUp, m: int, only: int | None, device: torch.device
) -> None:
    activation = Activation.SWIGLUOAI if layout == GateUp.INTERLEAVED else Activation.SILU
    cfg = Case(QuantScheme.FP8_BLOCK, torch.float16, activation, layout, **PARTIAL).config()
    routing = random_routing(m, cfg.num_experts, cfg.top_k, seed=m, only=only)
    assert triton_vs_reference(cfg, routing, device, fmt) < tolerance(cfg)


# (32, 64): tiles inside a scale block, several to a block along N and K, each partial block
# (72) ending in a partial tile; (128, 128): a tile a scale block
@pytest.mark.parametrize(("block_n", "block_k"), [(32, 64), (128, 128)])
def test_fp8_block_partial_blocks_with_other_tiles_match_reference(
    block_n: int, block_k: int, device: torch.device
) -> None:
    cfg = Case(QuantScheme.FP8_BLOCK, torch.float16, **PARTIAL).config()
    tile = GemmTile(block_n, block_k, 4, 2)
    fixed = tiles.LayerTiles(16, tile, tile)
    err = triton_vs_reference(cfg, random_routing(7, 4, 2, seed=11), device, tiles=fixed)
    assert err < tolerance(cfg)


def test_deep_gemm_alone_refuses_partial_fp8_blocks_saying_why() -> None:
    cfg = Case(QuantScheme.FP8_BLOCK, torch.float16, **PARTIAL).config()
    for cls in (DeepGemmExperts, TritonOrDeepGemmExperts):
        support = cls.check_config(cfg)
        assert not support and "hidden_size=200 is not a multiple of 128" in support.reason


@pytest.mark.parametrize("how", list(ActQuant))
@pytest.mark.parametrize(("rows", "k"), [(1, 300), (13, 2048), (5, 1100)])
def test_the_quantiser_writes_the_twins_values_on_the_rows_here_only(
    device: torch.device, how: ActQuant, rows: int, k: int
) -> None:
    """Odd rows (a pair of another rank's expert, -1) are skipped: their q and scale keep what
    the buffers held. The rows quantised are the torch twin's bit for bit on a GPU. In the
    interpreter the scale is the GPU's amax * float32(1 / 448), an ulp from the CPU twin's
    division, so a q may be its neighbour, and the fp8 cast drops a mantissa carry (126.6
    becomes 64: quantize.py's docstring), half the twin's value there."""
    x = torch.randn(rows, k, device=device) * torch.rand(rows, 1, device=device) * 10
    here = None
    kept = torch.ones(rows, dtype=torch.bool)
    if how != ActQuant.TENSOR:  # one scale over every row: nothing to skip
        here = torch.tensor([-1 if r % 2 else 0 for r in range(rows)], device=device)
        kept = here.cpu() >= 0
    q_ref, scale_ref = quantize_activation(x, how)
    q = torch.full((rows, k), 0x7F, dtype=torch.uint8, device=device)
    scale = torch.full_like(scale_ref, -1.0)
    quantize_into(x, q, scale, how, here)
    q, scale, q_ref, scale_ref = q.cpu(), scale.cpu(), q_ref.cpu(), scale_ref.cpu()
    exact = device.type == "cuda"
    if how != ActQuant.TENSOR:
        assert (scale[~kept] == -1.0).all() and (q[~kept] == 0x7F).all()
        scale, scale_ref = scale[kept], scale_ref[kept]
    torch.testing.assert_close(scale, scale_ref, rtol=0 if exact else 2**-23, atol=0)
    codes, codes_ref = q[kept], q_ref[kept].view(torch.uint8)
    differ = codes != codes_ref
    if exact:
        assert not differ.any()
        return
    got, want = codes[differ].view(FP8).float(), codes_ref[differ].view(FP8).float()
    neighbours = (codes[differ].int() - codes_ref[differ].int()).abs() == 1
    assert (neighbours | (got * 2 == want)).all()
