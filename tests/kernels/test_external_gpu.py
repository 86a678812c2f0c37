"""External backends on the GPU against the float32 reference backend: DeepSeek-V3 (fp8 block)
and gpt-oss (MXFP4, swigluoai with biases) layers, scaled down and at full size."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from moe_serve.bench.shapes import SHAPES
from moe_serve.kernels import selection
from moe_serve.kernels.accuracy import relative_error, tolerance
from moe_serve.kernels.config import Activation, ActivationSpec
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.layer_graphs import FINE_FROM, token_buckets
from moe_serve.kernels.prepare_finalize.batched import SYNC_FREE_TOKENS
from moe_serve.kernels.tensors import Routing
from tests.kernels.external_cases import layer_inputs, layer_weights, modular, reference_output

pytestmark = pytest.mark.gpu
logger = logging.getLogger(__name__)
CUDA = torch.device("cuda")
TOKENS = [1, 64, 333, 4096]
DEEPSEEK_V3 = ["deepseek-v3-small", "deepseek-v3"]
GPT_OSS = ["gpt-oss-small", "gpt-oss"]
DEEPSEEK_BACKENDS = ["deep-gemm", "deep-gemm-batched", "triton-or-deep-gemm", "auto"]
GPT_OSS_BACKENDS = ["oai-triton", "oai-triton-unfused", "auto"]


def _check(name: str, backend: str, m: int, crowded: bool = False) -> str:
    cfg = SHAPES[name]
    choice = selection.select(cfg, CUDA, backend)
    experts = choice.experts(cfg, layer_weights(name))
    hidden, _, routing = layer_inputs(name, m, crowded)
    out = modular(experts).forward(hidden, routing)
    assert out.shape == hidden.shape and out.dtype == cfg.dtype
    err = relative_error(out, reference_output(name, m, crowded))
    logger.info("%s %s M=%d: %s, relative error %.2e", name, backend, m, choice.experts.name, err)
    assert err < tolerance(cfg), f"{choice.experts.name}: {err:.3g}"
    return getattr(experts, "last_ran", choice.experts.name)


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("name", DEEPSEEK_V3)
@pytest.mark.parametrize("backend", DEEPSEEK_BACKENDS)
def test_deepseek_v3_matches_reference(backend: str, name: str, m: int) -> None:
    ran = _check(name, backend, m)
    assert ran != "reference"  # on Hopper every fp8-block path has a fast backend


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("name", GPT_OSS)
@pytest.mark.parametrize("backend", GPT_OSS_BACKENDS)
def test_gpt_oss_mxfp4_matches_reference(backend: str, name: str, m: int) -> None:
    assert _check(name, backend, m) != "reference"


@pytest.mark.parametrize("m", [1, 64, 333])
@pytest.mark.parametrize("backend", ["oai-triton", "oai-triton-unfused"])
def test_gpt_oss_bf16_matches_reference(backend: str, m: int) -> None:
    _check("gpt-oss-bf16-small", backend, m)


@pytest.mark.parametrize(
    "backend", ["deep-gemm", "deep-gemm-batched", "triton-or-deep-gemm", "oai-triton"]
)
def test_all_tokens_on_the_same_experts_and_the_rest_empty(backend: str) -> None:
    name = "gpt-oss-small" if backend.startswith("oai") else "deepseek-v3-small"
    _check(name, backend, 333, crowded=True)


def test_unfused_runs_any_activation() -> None:
    cfg = SHAPES["gpt-oss-bf16-small"]
    silu = dataclasses.replace(cfg, activation=ActivationSpec(Activation.SILU))
    weights = layer_weights("gpt-oss-bf16-small")
    hidden, _, routing = layer_inputs("gpt-oss-bf16-small", 64)
    expected = modular(ReferenceExperts(silu, weights)).forward(hidden, routing)
    actual = modular(selection.select(silu, CUDA, "oai-triton-unfused").experts(silu, weights))
    assert relative_error(actual.forward(hidden, routing), expected) < tolerance(silu)


def test_backends_report_on_this_gpu() -> None:
    """What /backends shows on Hopper: every external backend available but the SM100 one."""
    rejected = selection.select(SHAPES["deepseek-v3"], CUDA).rejected
    assert {"deep-gemm", "deep-gemm-batched", "triton-or-deep-gemm"}.isdisjoint(rejected)
    if torch.cuda.get_device_capability() == (9, 0):
        assert rejected["deep-gemm-fp4"] == "requires SM100 (Blackwell); this GPU is sm_90"
    rejected = selection.select(SHAPES["gpt-oss"], CUDA).rejected
    assert {"oai-triton", "oai-triton-unfused"}.isdisjoint(rejected)


@pytest.mark.parametrize("backend", ["oai-triton", "oai-triton-unfused"])
def test_mxfp4_rows_of_the_last_expert_stay_finite_over_freed_nan_bytes(backend: str) -> None:
    """matmul_ogs reads past the last expert's swizzled scales (K = 320 is not a whole K block):
    with 0xff (E8M0 NaN) bytes left in the allocator, those rows came back NaN now and then."""
    cfg = SHAPES["gpt-oss-small"]
    torch.full((256 << 20,), 0xFF, dtype=torch.uint8, device=CUDA)  # freed at once: NaN bytes
    experts = selection.select(cfg, CUDA, backend).experts(cfg, layer_weights("gpt-oss-small"))
    for m in (1, 2, 32, 48, 64):  # rows to the last expert failed at 2, 32, 48 or 64
        hidden, _, routing = layer_inputs("gpt-oss-small", m, False)
        out = modular(experts).forward(hidden, routing)
        assert torch.isfinite(out).all(), f"M={m}: rows {(~torch.isfinite(out)).any(1).nonzero()}"


DECODE_BUCKETS = token_buckets(FINE_FROM)  # 1, 2, 4, ..., 64


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("deepseek-v3", "deep-gemm"),
        ("deepseek-v3", "deep-gemm-batched"),
        ("deepseek-v3", "triton-batched"),
        ("deepseek-v3", "triton-or-deep-gemm"),
        ("gpt-oss", "oai-triton"),
        ("gpt-oss", "oai-triton-unfused"),
    ],
)
def test_no_forward_up_to_the_largest_decode_bucket_syncs_with_the_host(
    name: str, backend: str
) -> None:
    """Every decode bucket's forward (prepare, experts, finalize) with torch's sync debug mode
    set to raise: one .item(), nonzero or .tolist() fails it. Warmed up first (JIT compiles)."""
    cfg = SHAPES[name]
    experts = selection.select(cfg, CUDA, backend).experts(cfg, layer_weights(name))
    kernel = modular(experts)
    inputs = {m: layer_inputs(name, m) for m in DECODE_BUCKETS}
    for hidden, _, routing in inputs.values():
        kernel.forward(hidden, routing)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for m, (hidden, _, routing) in inputs.items():
            out = kernel.forward(hidden, routing)
            assert out.shape == hidden.shape, m
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for m, (hidden, _, routing) in inputs.items():  # and still right
        err = relative_error(kernel.forward(hidden, routing), reference_output(name, m))
        assert err < tolerance(cfg), f"M={m}: {err:.3g}"


@pytest.mark.parametrize("backend", ["deep-gemm-batched", "triton-batched"])
def test_batched_forward_filling_its_capacity_makes_no_host_sync(backend: str) -> None:
    """The batched prepare's largest sync-free forward with every token on the same k experts:
    those experts' counts equal the capacity (M rows each), the rest are empty."""
    name, m = "deepseek-v3-small", SYNC_FREE_TOKENS
    cfg = SHAPES[name]
    kernel = modular(selection.select(cfg, CUDA, backend).experts(cfg, layer_weights(name)))
    hidden, _, routing = layer_inputs(name, m, crowded=True)
    kernel.forward(hidden, routing)  # JIT compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = kernel.forward(hidden, routing)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    err = relative_error(out, reference_output(name, m, crowded=True))
    assert err < tolerance(cfg), f"{err:.3g}"


@pytest.mark.parametrize("m", [1, 333])
@pytest.mark.parametrize("backend", ["deep-gemm", "deep-gemm-batched"])
def test_deep_gemm_skips_pairs_of_other_ranks_and_empty_experts(backend: str, m: int) -> None:
    """Expert-parallel ids (-1: another rank's expert) and experts nobody picked: the psum
    layout (the batched prepare) gives them no rows, and their slots add nothing."""
    name = "deepseek-v3-small"
    cfg = SHAPES[name]
    weights = layer_weights(name)
    hidden, _, routing = layer_inputs(name, m)
    ids = routing.topk_ids.clone()
    ids[ids % 3 == 0] = -1
    ids[:, 0] = torch.where(ids[:, 0] >= 0, 1, -1)  # expert 1 crowded, 0, 3, 6... empty
    routing = Routing(ids, routing.topk_weights)
    expected = modular(ReferenceExperts(cfg, weights)).forward(hidden, routing).float()
    experts = selection.select(cfg, CUDA, backend).experts(cfg, weights)
    err = relative_error(modular(experts).forward(hidden, routing), expected)
    assert err < tolerance(cfg), f"{err:.3g}"


@pytest.mark.parametrize("backend", ["oai-triton", "oai-triton-unfused"])
def test_oai_sum_lands_in_the_target_itself_or_through_one_pass(backend: str) -> None:
    """GEMM2's scatter-sum writes a plain target of the layer's dtype itself; a target with the
    shared experts' output to add, or of float32 (a partial sum), takes the sum through a pass.
    Every way gives the same sum."""
    from moe_serve.kernels.prepare_finalize.no_ep import NoEP
    from moe_serve.kernels.stages import DispatchSpec, SideOutput, SumTarget
    from moe_serve.kernels.workspace import Workspace

    name, m = "gpt-oss-small", 37
    cfg = SHAPES[name]
    experts = selection.select(cfg, CUDA, backend).experts(cfg, layer_weights(name))
    hidden, _, routing = layer_inputs(name, m, False)
    ws = Workspace(CUDA)
    x = NoEP().prepare(hidden, routing, DispatchSpec(None, cfg.num_experts), ws)
    alone = experts.apply(x, ws).clone()
    assert relative_error(alone, reference_output(name, m, False)) < tolerance(cfg)

    out = torch.full_like(hidden, float("nan"))
    assert experts.apply(x, ws, SumTarget(out)) is out
    assert torch.equal(out, alone)

    extra = torch.randn(m, cfg.hidden_size, device=CUDA)
    out = torch.full_like(hidden, float("nan"))
    assert experts.apply(x, ws, SumTarget(out, SideOutput(extra))) is out
    assert torch.equal(out, (alone.float() + extra).to(cfg.dtype))

    partial = torch.full(hidden.shape, float("nan"), device=CUDA)
    assert experts.apply(x, ws, SumTarget(partial)) is partial
    assert torch.equal(partial, alone.float())
