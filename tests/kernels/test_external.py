"""External backends without their libraries: capability reasons, the pure-torch layout
conversions, and the experts' own data movement run against torch twins of DeepGEMM's documented
GEMM contract. The DeepGEMM experts' Triton passes run on the `device` fixture: the interpreter
on a CPU machine, the GPU where there is one (the twins compute on either)."""

from __future__ import annotations

import types

import pytest
import torch

from moe_serve.kernels import selection
from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.activations import apply_activation
from moe_serve.kernels.config import Activation, ActivationSpec, GateUp, MoEConfig, RoutingConfig
from moe_serve.kernels.experts import deep_gemm, deep_gemm_fp4, oai_triton
from moe_serve.kernels.experts._triton.sort_pairs import sort_pairs
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.experts.token_switch import TritonOrDeepGemmExperts
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.prepare_finalize.batched import Batched
from moe_serve.kernels.prepare_finalize.no_ep import NoEP
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.quantize import dequantize_mxfp4, dequantize_weight, quantize_mxfp4
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.registry import experts_backends
from moe_serve.kernels.routing import route
from moe_serve.kernels.stages import NO_TRITON
from moe_serve.kernels.tensors import Routing
from moe_serve.kernels.workspace import Workspace

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
EXTERNAL = (
    "deep-gemm",
    "deep-gemm-batched",
    "deep-gemm-fp4",
    "triton-or-deep-gemm",
    "oai-triton",
    "oai-triton-unfused",
)
ALIGN = 8  # a small contiguous-layout alignment keeps the CPU cases tiny


def _fp8_block_config(**kw: object) -> MoEConfig:
    base = {
        "num_experts": 5,
        "hidden_size": 256,
        "intermediate_size": 128,
        "routing": RoutingConfig(top_k=3),
        "quant": QuantConfig(QuantScheme.FP8_BLOCK),
        "dtype": torch.float32,
    }
    return MoEConfig(**(base | kw))


def _gpt_oss_config(scheme: QuantScheme = QuantScheme.MXFP4, **kw: object) -> MoEConfig:
    base = {
        "num_experts": 4,
        "hidden_size": 128,
        "intermediate_size": 64,
        "routing": RoutingConfig(top_k=2, softmax_after_topk=True),
        "activation": ActivationSpec(Activation.SWIGLUOAI, GateUp.INTERLEAVED),
        "quant": QuantConfig(scheme),
        "has_bias": True,
    }
    return MoEConfig(**(base | kw))


# ---- capability reasons ----------------------------------------------------------------------


@pytest.mark.parametrize("name", EXTERNAL)
def test_every_external_backend_is_registered_and_refuses_the_cpu(name: str) -> None:
    cls = experts_backends()[name]
    assert cls.supports(_fp8_block_config(), CPU).reason == "runs on cuda, not cpu"


@pytest.mark.skipif(
    not isinstance(deep_gemm.import_deep_gemm(), str), reason="deep_gemm is installed here"
)
@pytest.mark.parametrize(
    "name", ["deep-gemm", "deep-gemm-batched", "deep-gemm-fp4", "triton-or-deep-gemm"]
)
def test_deep_gemm_backends_name_the_missing_package(name: str) -> None:
    reason = experts_backends()[name].environment(CUDA).reason
    assert reason.startswith("deep_gemm not importable: ModuleNotFoundError")


@pytest.mark.skipif(
    not isinstance(oai_triton.import_triton_kernels(), str), reason="triton_kernels is installed"
)
@pytest.mark.parametrize("name", ["oai-triton", "oai-triton-unfused"])
def test_oai_backends_name_the_missing_package(name: str) -> None:
    reason = experts_backends()[name].environment(CUDA).reason
    assert reason.startswith("triton_kernels not importable: ")


def test_deep_gemm_fp4_needs_blackwell_when_the_package_is_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(deep_gemm, "import_deep_gemm", lambda: types.ModuleType("deep_gemm"))
    monkeypatch.setattr(deep_gemm, "cuda_capability", lambda device: (9, 0))
    reason = deep_gemm_fp4.DeepGemmFp4Experts.environment(CUDA).reason
    assert reason == "requires SM100 (Blackwell); this GPU is sm_90"
    assert deep_gemm.DeepGemmExperts.environment(CUDA).ok


def test_deep_gemm_glue_needs_triton_where_the_fp4_backend_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(deep_gemm, "import_deep_gemm", lambda: types.ModuleType("deep_gemm"))
    monkeypatch.setattr(deep_gemm, "cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(deep_gemm, "HAS_TRITON", False)
    for name in ("deep-gemm", "deep-gemm-batched", "triton-or-deep-gemm"):
        assert experts_backends()[name].environment(CUDA) == NO_TRITON, name
    monkeypatch.setattr(deep_gemm, "cuda_capability", lambda device: (10, 0))
    assert deep_gemm_fp4.DeepGemmFp4Experts.environment(CUDA).ok  # torch between its GEMMs


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"hidden_size": 320}, "hidden_size=320 is not a multiple of 128"),
        ({"intermediate_size": 96}, "intermediate_size=96 is not a multiple of 128"),
    ],
)
def test_deep_gemm_refuses_partial_blocks(kw: dict, reason: str) -> None:
    for cls in (deep_gemm.DeepGemmExperts, TritonOrDeepGemmExperts):
        assert cls.check_config(_fp8_block_config(**kw)).reason == reason


def test_oai_refuses_non_bf16_activations_and_takes_input_weighting() -> None:
    oai = oai_triton.OaiTritonExperts
    assert oai.check_config(_gpt_oss_config(dtype=torch.float32)).reason.startswith(
        "runs bf16 activations"
    )
    assert oai.check_config(_gpt_oss_config())
    on_input = _gpt_oss_config(
        routing=RoutingConfig(top_k=1, softmax_after_topk=True), apply_router_weight_on_input=True
    )
    assert oai.check_config(on_input)  # the modular path weighs the input in prepare


# ---- DeepGEMM contiguous layout ----------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["random", "m1", "all_to_one_expert", "empty_experts", "ids_not_here"]
)
def test_contiguous_layout_pads_each_expert_to_the_alignment(case: str) -> None:
    g = torch.Generator().manual_seed(0)
    num_experts, k = 6, 2
    m = 1 if case == "m1" else 37
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(m)])
    if case == "all_to_one_expert":
        ids = torch.stack((torch.full((m,), 4), torch.full((m,), -1)), 1)
    if case == "empty_experts":
        ids = ids % 2  # experts 2..5 get nothing
    if case == "ids_not_here":
        ids[::3, 0] = -1
    layout = deep_gemm_fp4.contiguous_layout(ids.int(), num_experts, ALIGN)

    flat = ids.flatten()
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    assert layout.num_rows == int(((counts + ALIGN - 1) // ALIGN * ALIGN).sum())
    assert sorted(layout.pairs.tolist()) == torch.nonzero(flat >= 0).squeeze(1).tolist()
    assert torch.equal(layout.m_indices[layout.rows].long(), flat[layout.pairs])
    assert int((layout.m_indices >= 0).sum()) == layout.pairs.numel()  # the rest is padding (-1)
    pair_at_row = torch.full((layout.num_rows,), -1, dtype=torch.long)
    pair_at_row[layout.rows] = layout.pairs
    for e in range(num_experts):
        rows = torch.nonzero(layout.m_indices == e).squeeze(1)
        if rows.numel():  # one run per expert, starting on an aligned row, in token order
            assert rows[0] % ALIGN == 0 and rows[-1] - rows[0] + 1 == rows.numel()
            assert torch.all(pair_at_row[rows].diff() > 0)


# ---- torch twins of DeepGEMM's GEMMs, per its README contract ---------------------------------


def _dequant_rows(a: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return a.float() * scale.repeat_interleave(group, dim=-1)[..., : a.shape[-1]]


def _fake_deep_gemm() -> types.ModuleType:
    """D = A @ B.T per group, A with 1x128 float scales, B with 128x128 block scales."""
    fp8_block = QuantConfig(QuantScheme.FP8_BLOCK)

    def contiguous(a, b, d, psum, use_psum_layout=False, expected_m_for_psum_layout=None):
        """Expert e's rows: [round_up(psum[e - 1], ALIGN), psum[e]); the others untouched."""
        assert use_psum_layout and expected_m_for_psum_layout >= 1
        assert a[1].stride(0) == 1 and d.shape[0] % ALIGN == 0  # MN-major scales, whole blocks
        w = dequantize_weight(b[0], b[1], fp8_block)  # [E, N, K]
        end = 0
        for e, stop in enumerate(psum.tolist()):
            start = -(-end // ALIGN) * ALIGN
            assert start <= stop <= d.shape[0]
            d[start:stop] = (_dequant_rows(a[0][start:stop], a[1][start:stop], 128) @ w[e].T).to(
                d.dtype
            )
            end = stop

    contiguous.__doc__ = "m_grouped_fp8_gemm_nt_contiguous(..., use_psum_layout: bool = False)"

    def masked(a, b, d, masked_m, expected_m):
        assert expected_m >= 1 and a[0].shape[1] % deep_gemm.MASKED_M_ALIGNMENT == 0
        assert a[1].stride(1) == 1  # MN-major scales
        w = dequantize_weight(b[0], b[1], fp8_block)
        for e, count in enumerate(masked_m.tolist()):
            d[e, :count] = (_dequant_rows(a[0][e, :count], a[1][e, :count], 128) @ w[e].T).to(
                d.dtype
            )

    def fp8_fp4_contiguous(a, b, d, m_indices, recipe_a, recipe_b):
        assert recipe_a == (1, 128) and recipe_b == (1, 32)
        packed, sf = b
        n_groups = packed.shape[-1] * 2 // 32
        dense = torch.empty(sf.shape, dtype=sf.dtype).copy_(sf)  # row-major strides, even for 1 int
        exponents = dense.view(torch.uint8)[..., :n_groups]  # undo the int32 packing
        w = dequantize_mxfp4(packed.view(torch.uint8), exponents)
        x = _dequant_rows(*a, 128)
        for e in torch.unique(m_indices[m_indices >= 0]).tolist():
            rows = m_indices == e
            d[rows] = (x[rows] @ w[e].T).to(d.dtype)

    fake = types.ModuleType("deep_gemm")
    fake.get_mk_alignment_for_contiguous_layout = lambda: ALIGN
    fake.m_grouped_fp8_gemm_nt_contiguous = contiguous
    fake.m_grouped_fp8_gemm_nt_masked = masked
    fake.m_grouped_fp8_fp4_gemm_nt_contiguous = fp8_fp4_contiguous
    return fake


@pytest.fixture
def fake_deep_gemm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    fake = _fake_deep_gemm()
    monkeypatch.setattr(deep_gemm, "import_deep_gemm", lambda: fake)
    return fake


def _run(experts, cfg: MoEConfig, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
    pf = Batched() if experts.format == "batched" else NoEP()
    return ModularKernel(pf, experts, Workspace(hidden.device)).forward(hidden, routing)


def _routing(
    cfg: MoEConfig, m: int, seed: int, device: torch.device = CPU
) -> tuple[torch.Tensor, Routing]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, cfg.hidden_size, generator=g).to(device, cfg.dtype)
    return hidden, route(torch.randn(m, cfg.num_experts, generator=g).to(device), cfg.routing)


@pytest.mark.parametrize("m", [1, 13])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cls", [deep_gemm.DeepGemmExperts, deep_gemm.DeepGemmBatchedExperts])
def test_deep_gemm_data_movement_matches_reference(
    fake_deep_gemm: types.ModuleType, device: torch.device, cls: type, bias: bool, m: int
) -> None:
    cfg = _fp8_block_config(has_bias=bias)
    weights = random_expert_weights(cfg, seed=1).to(device)
    hidden, routing = _routing(cfg, m, seed=2, device=device)
    expected = _run(ReferenceExperts(cfg, weights), cfg, hidden, routing)
    actual = _run(cls(cfg, weights), cfg, hidden, routing)
    assert relative_error(actual, expected) < 2e-2  # bf16 GEMM outputs before the fp8 rounding


def test_deep_gemm_skips_ids_of_other_ranks(
    fake_deep_gemm: types.ModuleType, device: torch.device
) -> None:
    cfg = _fp8_block_config()
    weights = random_expert_weights(cfg, seed=3).to(device)
    hidden, routing = _routing(cfg, 9, seed=4, device=device)
    ids = routing.topk_ids.clone()
    ids[ids == 2] = -1  # expert 2 lives elsewhere: its slots must add nothing
    routing = Routing(ids, routing.topk_weights)
    expected = _run(ReferenceExperts(cfg, weights), cfg, hidden, routing)
    actual = _run(deep_gemm.DeepGemmExperts(cfg, weights), cfg, hidden, routing)
    assert relative_error(actual, expected) < 2e-2


# ---- DeepGEMM FP4 (SM100): weight preparation ----------------------------------------------


def test_ue8m0_packing_is_mn_major_tma_aligned_with_the_first_group_in_the_low_byte() -> None:
    exponents = torch.randint(100, 140, (3, 10, 6), dtype=torch.uint8)
    packed = deep_gemm_fp4.pack_ue8m0_mn_major(exponents)
    assert packed.dtype == torch.int32 and packed.shape == (3, 10, 2)
    assert packed.stride() == (2 * 12, 1, 12)  # MN stride 1, K stride = MN rounded up to 4
    as_bytes = packed.contiguous().view(torch.uint8)  # [3, 10, 8]
    assert torch.equal(as_bytes[..., :6], exponents)
    assert torch.all(as_bytes[..., 6:] == 127)  # padding groups scale by 1.0


def test_ue8m0_activation_scales_are_powers_of_two_that_keep_fp8_in_range() -> None:
    x = torch.randn(7, 300) * torch.logspace(-3, 3, 300)
    q, scale = deep_gemm_fp4.quantize_fp8_ue8m0(x)
    assert scale.shape == (7, 3)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    assert q.float().abs().max() <= 448
    assert relative_error(_dequant_rows(q, scale, 128), x) < 4e-2


def test_deep_gemm_fp4_weights_feed_the_fp4_gemm_unchanged(
    fake_deep_gemm: types.ModuleType,
) -> None:
    cfg = _gpt_oss_config(dtype=torch.float32, num_experts=3, hidden_size=256, intermediate_size=96)
    weights = random_expert_weights(cfg, seed=5)
    hidden, routing = _routing(cfg, 11, seed=6)
    expected = _run(ReferenceExperts(cfg, weights), cfg, hidden, routing)
    actual = _run(deep_gemm_fp4.DeepGemmFp4Experts(cfg, weights), cfg, hidden, routing)
    assert relative_error(actual, expected) < 6e-2  # two fp8 roundings the reference skips


# ---- triton_kernels: gate/up interleave and the matmul_ogs sort --------------------------------


def test_interleaving_split_weights_keeps_the_activation() -> None:
    cfg = _gpt_oss_config(dtype=torch.float32)
    w13 = torch.randn(cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size)
    bias = torch.randn(cfg.num_experts, 2 * cfg.intermediate_size)
    x = torch.randn(5, cfg.hidden_size)
    split = ActivationSpec(Activation.SWIGLUOAI, GateUp.SPLIT)
    interleaved = ActivationSpec(Activation.SWIGLUOAI, GateUp.INTERLEAVED)
    for e in range(cfg.num_experts):
        want = apply_activation(x @ w13[e].T + bias[e], split)
        w_i, b_i = oai_triton.interleave_gate_up(w13)[e], oai_triton.interleave_gate_up(bias)[e]
        torch.testing.assert_close(apply_activation(x @ w_i.T + b_i, interleaved), want)


def test_interleaving_moves_mxfp4_values_and_scales_together() -> None:
    w = torch.randn(2, 64, 64)
    packed, scale = quantize_mxfp4(w)
    inter = dequantize_mxfp4(
        oai_triton.interleave_gate_up(packed), oai_triton.interleave_gate_up(scale)
    )
    torch.testing.assert_close(
        inter, oai_triton.interleave_gate_up(dequantize_mxfp4(packed, scale))
    )


def test_sorted_pairs_reproduce_the_moe_through_gather_and_scatter() -> None:
    """matmul_ogs' contract: sorted row r reads token sorted_pairs[r] // k; GEMM2 scatters it
    back to the token, weighed by row_weights[r]; rows of expert e are contiguous."""
    cfg = _gpt_oss_config(dtype=torch.float32)
    weights = random_expert_weights(cfg, seed=7)
    hidden, routing = _routing(cfg, 9, seed=8)
    routing = Routing(routing.topk_ids.clone(), routing.topk_weights)
    routing.topk_ids[:, 0] = 3  # expert 3 gets every token; some others get none
    idx = sort_pairs(routing.topk_ids, routing.topk_weights, cfg.num_experts)
    k = cfg.top_k
    assert torch.equal(idx.row_of_pair[idx.sorted_pairs.long()], torch.arange(9 * k).int())
    expert_of_row = routing.topk_ids.flatten()[idx.sorted_pairs.long()]
    assert torch.equal(expert_of_row, torch.sort(expert_of_row).values)
    assert (
        idx.tokens_per_expert.tolist()
        == torch.bincount(routing.topk_ids.flatten(), minlength=cfg.num_experts).tolist()
    )

    w13 = dequantize_weight(weights.w13, weights.w13_scale, cfg.quant)
    w2 = dequantize_weight(weights.w2, weights.w2_scale, cfg.quant)
    tokens = idx.sorted_pairs.long() // k
    e = expert_of_row.long()
    h = torch.einsum("rk,rnk->rn", hidden[tokens], w13[e]) + weights.w13_bias[e]
    y = torch.einsum("ri,rhi->rh", apply_activation(h, cfg.activation), w2[e]) + weights.w2_bias[e]
    out = torch.zeros(9, cfg.hidden_size).index_add_(0, tokens, y * idx.row_weights[:, None])
    expected = _run(ReferenceExperts(cfg, weights), cfg, hidden, routing)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


# ---- triton-or-deep-gemm -----------------------------------------------------------------------


@pytest.mark.parametrize(("m", "ran"), [(3, "small"), (40, "deep-gemm")])
def test_triton_or_deep_gemm_switches_at_the_measured_token_count(
    fake_deep_gemm: types.ModuleType, device: torch.device, m: int, ran: str
) -> None:
    cfg = _fp8_block_config()
    weights = random_expert_weights(cfg, seed=9).to(device)
    experts = TritonOrDeepGemmExperts.at(cfg, device, 32, "test rule")(cfg, weights)
    # the triton experts cannot run on the CPU: there the reference stands in
    small = experts.member(1).name
    assert small == ("triton" if device.type == "cuda" else "reference")
    assert experts.by_tokens() == ((1, small), (32, "deep-gemm"))
    hidden, routing = _routing(cfg, m, seed=10, device=device)
    actual = _run(experts, cfg, hidden, routing)
    assert experts.last_ran == (small if ran == "small" else ran)
    expected = _run(ReferenceExperts(cfg, weights), cfg, hidden, routing)
    assert relative_error(actual, expected) < 2e-2


def test_triton_or_deep_gemm_without_a_measurement_runs_deep_gemm_at_every_size(
    fake_deep_gemm: types.ModuleType,
) -> None:
    cfg = _fp8_block_config()
    min_tokens, source = selection.deep_gemm_min_tokens(cfg, CPU)  # no rule table for the CPU
    experts = TritonOrDeepGemmExperts.at(cfg, CPU, min_tokens, source)(
        cfg, random_expert_weights(cfg)
    )
    assert min_tokens == 0 and experts.member(1).name == "deep-gemm"
    assert experts.by_tokens() == ((1, "deep-gemm"),)


def test_triton_or_deep_gemm_where_deep_gemm_never_won_runs_triton(
    fake_deep_gemm: types.ModuleType,
) -> None:
    cfg = _fp8_block_config()
    switch = TritonOrDeepGemmExperts.at(cfg, CPU, None, "test rule")
    experts = switch(cfg, random_expert_weights(cfg))
    assert experts.member(1 << 20).name == "reference"  # triton's stand-in on the CPU
    assert experts.by_tokens() == ((1, "reference"),)
