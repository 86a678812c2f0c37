"""The Triton experts on the GPU against the reference backend: every scheme x format at
M in {1, 7, 64, 333, 4096}, bf16 included; every activation and layout; all tokens on one
expert, empty experts, an expert_map with -1; K = 320 and N = 192 (2I = 384), multiples of none
of the 128-wide tiles. Tolerances: tests/kernels/triton_cases.py (one table).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moe_serve.kernels.accuracy import relative_error, tolerance
from moe_serve.kernels.config import Activation, GateUp
from moe_serve.kernels.experts._triton.codes import W_MXFP4
from moe_serve.kernels.experts._triton.grouped_gemm import GemmTile, _decoded_pairs
from moe_serve.kernels.experts._triton.tiles import LayerTiles
from moe_serve.kernels.layer import LayerWeights, RouterWeights, build_layer
from moe_serve.kernels.quant_scheme import ActQuant, QuantScheme
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.routing import contiguous_expert_map
from moe_serve.kernels.selection import select
from moe_serve.kernels.tensors import Format, ForwardInputs
from tests.kernels.triton_cases import Case, random_routing, triton_vs_reference

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
TOKENS = (1, 7, 64, 333, 4096)
FORMATS = (Format.STANDARD, Format.BATCHED)


def _gpu_case(scheme: QuantScheme, dtype: torch.dtype = torch.bfloat16, **kw: object) -> Case:
    # group 64: int4 needs K (320 and 192) to be a multiple of the group
    return Case(scheme, dtype, num_experts=8, hidden=320, intermediate=192, group_size=64, **kw)


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", list(QuantScheme))
def test_triton_matches_reference_on_gpu(scheme: QuantScheme, fmt: Format, m: int) -> None:
    cfg = _gpu_case(scheme).config()
    routing = random_routing(m, cfg.num_experts, cfg.top_k, seed=m)
    assert triton_vs_reference(cfg, routing, CUDA, fmt) < tolerance(cfg)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_BLOCK, QuantScheme.MXFP4])
def test_other_activation_dtypes_match_reference_on_gpu(
    scheme: QuantScheme, dtype: torch.dtype
) -> None:
    cfg = _gpu_case(scheme, dtype).config()
    routing = random_routing(333, cfg.num_experts, cfg.top_k, seed=2)
    assert triton_vs_reference(cfg, routing, CUDA) < tolerance(cfg)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("layout", list(GateUp))
def test_every_activation_and_layout_with_bias_matches_reference_on_gpu(
    activation: Activation, layout: GateUp, fmt: Format
) -> None:
    cfg = _gpu_case(QuantScheme.NONE, activation=activation, gate_up=layout, has_bias=True)
    routing = random_routing(64, 8, 2, seed=3)
    assert triton_vs_reference(cfg.config(), routing, CUDA, fmt) < tolerance(cfg.config())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_TENSOR, QuantScheme.MXFP4])
def test_all_tokens_on_one_expert_others_empty_match_reference_on_gpu(
    scheme: QuantScheme, fmt: Format
) -> None:
    cfg = _gpu_case(scheme, top_k=1).config()
    routing = random_routing(4096, 8, 1, seed=4, only=5)
    assert triton_vs_reference(cfg, routing, CUDA, fmt) < tolerance(cfg)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "scheme", [QuantScheme.NONE, QuantScheme.FP8_BLOCK, QuantScheme.INT4_W4A16]
)
def test_expert_map_skips_other_ranks_experts_on_gpu(scheme: QuantScheme, fmt: Format) -> None:
    cfg = _gpu_case(scheme, top_k=3).config()
    expert_map = contiguous_expert_map(8, rank=0, world_size=2)  # 4..7 are -1 here
    routing = random_routing(333, 8, 3, seed=5)
    assert triton_vs_reference(cfg, routing, CUDA, fmt, expert_map) < tolerance(cfg)


# per-pair GEMVs (decode): a 128-wide K step, a narrower GEMM2, as the tuned files use them
PER_PAIR = LayerTiles(16, GemmTile(32, 128, 4, 1), GemmTile(16, 128, 2, 1), per_pair=True)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("scheme", list(QuantScheme))
def test_per_pair_gemvs_match_reference_on_gpu(scheme: QuantScheme, m: int) -> None:
    cfg = _gpu_case(scheme).config()
    routing = random_routing(m, cfg.num_experts, cfg.top_k, seed=m)
    assert triton_vs_reference(cfg, routing, CUDA, tiles=PER_PAIR) < tolerance(cfg)


@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("layout", list(GateUp))
@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_BLOCK, QuantScheme.MXFP4])
def test_per_pair_gemvs_fuse_every_activation_and_layout_with_bias_on_gpu(
    scheme: QuantScheme, activation: Activation, layout: GateUp
) -> None:
    cfg = _gpu_case(scheme, activation=activation, gate_up=layout, has_bias=True).config()
    routing = random_routing(2, 8, 2, seed=3)
    assert triton_vs_reference(cfg, routing, CUDA, tiles=PER_PAIR) < tolerance(cfg)


@pytest.mark.parametrize("scheme", [QuantScheme.FP8_BLOCK, QuantScheme.INT4_W4A16])
def test_per_pair_gemvs_skip_other_ranks_and_share_one_expert_on_gpu(scheme: QuantScheme) -> None:
    cfg = _gpu_case(scheme, top_k=3).config()
    expert_map = contiguous_expert_map(8, rank=0, world_size=2)  # 4..7 are -1 here
    routing = random_routing(5, 8, 3, seed=5, only=2)  # every token's first slot on expert 2
    err = triton_vs_reference(cfg, routing, CUDA, expert_map=expert_map, tiles=PER_PAIR)
    assert err < tolerance(cfg)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_BLOCK, QuantScheme.MXFP4])
def test_per_pair_gemm2_sums_eight_slots_and_the_shared_output_on_gpu(
    scheme: QuantScheme, m: int
) -> None:
    """Qwen3-like routing (8 of 64 experts: per pair by the heuristic) on a rank holding half the
    experts: the eager forward, whose GEMM2 sums each token's slots and the shared output as it
    writes them, and the layer's forward (the decode graph, extra added after it) against the
    reference plus the shared output."""
    from moe_serve.kernels.experts.reference import ReferenceExperts
    from moe_serve.kernels.experts.triton import TritonExperts
    from moe_serve.kernels.modular import ModularKernel
    from moe_serve.kernels.prepare_finalize.no_ep import NoEP
    from moe_serve.kernels.stages import DispatchSpec, SideOutput, SumTarget
    from moe_serve.kernels.workspace import Workspace

    cfg = Case(scheme, torch.bfloat16, num_experts=64, hidden=320, intermediate=192, top_k=8,
               group_size=64).config()  # fmt: skip
    expert_map = contiguous_expert_map(64, rank=1, world_size=2).to(CUDA)  # 0..31 elsewhere
    weights = random_expert_weights(cfg).select(torch.arange(32, 64)).to(CUDA)
    experts = TritonExperts(cfg, weights)
    assert experts.tiles(m, CUDA).per_pair
    r = random_routing(m, 64, 8, seed=m)
    routing = type(r)(r.topk_ids.to(CUDA), r.topk_weights.to(CUDA))
    hidden = torch.randn(m, 320, device=CUDA).to(cfg.dtype)
    extra = torch.randn(m, 320, device=CUDA)
    ref = ModularKernel(NoEP(), ReferenceExperts(cfg, weights), Workspace(CUDA), expert_map)
    want = ref.forward(hidden, routing).float() + extra

    ws = Workspace(CUDA)
    layer = ModularKernel(NoEP(), experts, ws, expert_map)
    got = layer.forward(hidden, routing, shared=lambda: SideOutput(extra))
    assert relative_error(got.float(), want) < tolerance(cfg)
    spec = DispatchSpec(experts.act_quant(), 32, expert_map)
    x = NoEP().prepare(hidden, routing, spec, ws)
    assert (x.topk_ids < 0).any() and (x.topk_ids >= 0).any()
    buf = {n: ws.get(n, *s) for n, s in experts.workspace_shapes(m).items()}
    assert "triton_pair_out" not in buf
    out = torch.empty(m, 320, dtype=cfg.dtype, device=CUDA)
    eager = experts._forward(x, buf, SumTarget(out, SideOutput(extra)))
    assert eager is out
    assert relative_error(out.float(), want) < tolerance(cfg)


def test_auto_selects_triton_on_the_gpu_and_matches_reference_through_the_layer() -> None:
    cfg = _gpu_case(QuantScheme.NONE).config()
    assert select(cfg, CUDA, "triton").experts.name == "triton"
    assert "triton" not in select(cfg, CUDA).rejected
    assert "triton-batched" not in select(cfg, CUDA).rejected
    weights = LayerWeights(random_expert_weights(cfg).to(CUDA), RouterWeights())
    fast, _ = build_layer(cfg, weights, CUDA, backend="triton")
    ref, _ = build_layer(cfg, weights, CUDA, backend="reference")
    inputs = ForwardInputs(torch.randn(77, 320, device=CUDA), torch.randn(77, 8, device=CUDA))
    out = fast.forward(inputs).output
    assert relative_error(out, ref.forward(inputs).output) < tolerance(cfg)


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_TOKEN, QuantScheme.MXFP4])
def test_decode_graph_replays_match_the_eager_forward_for_fresh_inputs(
    scheme: QuantScheme, m: int
) -> None:
    from moe_serve.kernels.experts.triton import TritonExperts
    from moe_serve.kernels.prepare_finalize.no_ep import NoEP
    from moe_serve.kernels.stages import DispatchSpec
    from moe_serve.kernels.workspace import Workspace

    cfg = _gpu_case(scheme).config()
    experts = TritonExperts(cfg, random_expert_weights(cfg).to(CUDA))
    ws = Workspace(CUDA)
    spec = DispatchSpec(cfg.quant.spec.act_quant, cfg.num_experts)
    for seed in range(3):  # the first call captures, the next ones replay with new inputs
        r = random_routing(m, cfg.num_experts, cfg.top_k, seed=seed)
        routing = type(r)(r.topk_ids.to(CUDA), r.topk_weights.to(CUDA))
        hidden = torch.randn(m, cfg.hidden_size, device=CUDA).to(cfg.dtype)
        x = NoEP().prepare(hidden, routing, spec, ws)
        replayed = experts.apply(x, ws).clone()
        shapes = experts.workspace_shapes(m)
        eager = experts._forward(x, {n: ws.get(n, *s) for n, s in shapes.items()})
        assert torch.equal(replayed, eager)
    assert set(experts.graphs.graphs) == {(m, x.act_quant)}


@triton.jit
def _decode_every_byte_kernel(out_ptr, BF16: tl.constexpr):
    byte = tl.arange(0, 256).to(tl.uint8)
    w = _decoded_pairs(byte, W_MXFP4, BF16).to(tl.float32)
    tl.store(out_ptr + tl.arange(0, 256)[:, None] * 2 + tl.arange(0, 2)[None, :], w)


def test_mxfp4_decoded_in_bf16_equals_the_float32_decode_for_every_byte() -> None:
    """Both nibbles of every byte, signs (-0 of code 8) and the subnormal 0.5 included."""
    outs = []
    for bf16 in (False, True):
        out = torch.empty(256, 2, device=CUDA)
        _decode_every_byte_kernel[(1,)](out, BF16=bf16)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(torch.signbit(outs[0]), torch.signbit(outs[1]))
    assert outs[0][0x81].tolist() == [0.5, -0.0]


@pytest.mark.parametrize("how", list(ActQuant))
@pytest.mark.parametrize(("rows", "k"), [(1, 300), (7, 2048), (333, 7168)])
def test_triton_quantiser_is_bit_identical_to_the_torch_one(
    how: ActQuant, rows: int, k: int
) -> None:
    from moe_serve.kernels.experts._triton.quantize import quantize_rows
    from moe_serve.kernels.quantize import quantize_activation

    x = torch.randn(rows, k, device=CUDA) * torch.rand(rows, 1, device=CUDA) * 10
    q, scale = quantize_rows(x.to(torch.bfloat16), how)
    q_ref, scale_ref = quantize_activation(x.to(torch.bfloat16), how)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
