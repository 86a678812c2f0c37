"""The triton experts' GEMMs quantising their input as they load it (decode, fp8-block) answer
bit for bit as the separate quantising pass before each GEMM, on awkward shapes: K = 320 and
I = 192 (partial last 128-column groups), one token, all tokens on one expert, pairs of another
rank's experts."""

from __future__ import annotations

import pytest
import torch

import kernels.experts.triton as triton_experts
from kernels.quant_scheme import QuantScheme
from kernels.routing import contiguous_expert_map
from kernels.tensors import Format
from tests.kernels.triton_cases import Case, random_routing, run_triton

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
CASES = {
    "awkward": Case(QuantScheme.FP8_BLOCK, torch.bfloat16, num_experts=8, hidden=320,
                    intermediate=192, top_k=2),
    "wide": Case(QuantScheme.FP8_BLOCK, torch.bfloat16, num_experts=16, hidden=1024,
                 intermediate=512, top_k=4),
}  # fmt: skip


def _run_counting_quantise_passes(
    monkeypatch: pytest.MonkeyPatch, case: Case, m: int, only: int | None, split: bool
) -> tuple[torch.Tensor, int]:
    calls = []
    real = triton_experts.quantize_rows

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_experts, "quantize_rows", counted)
    cfg = case.config()
    routing = random_routing(m, cfg.num_experts, cfg.top_k, seed=m, only=only)
    expert_map = contiguous_expert_map(cfg.num_experts, rank=1, world_size=2) if split else None
    out = run_triton(cfg, routing, CUDA, Format.STANDARD, None, expert_map)
    return out, len(calls)


@pytest.mark.parametrize("split", [False, True], ids=["all-here", "half-here"])
@pytest.mark.parametrize("only", [None, 1], ids=["random", "one-expert"])
@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("name", list(CASES))
def test_quantising_on_load_equals_the_separate_pass_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, name: str, m: int, only: int | None, split: bool
) -> None:
    fused, passes = _run_counting_quantise_passes(monkeypatch, CASES[name], m, only, split)
    assert passes == 0  # both GEMMs quantised on load: neither pass ran
    monkeypatch.setattr(triton_experts, "QUANTIZE_ON_LOAD_MAX_TOKENS", 0)
    separate, passes = _run_counting_quantise_passes(monkeypatch, CASES[name], m, only, split)
    assert passes == 2  # the input and the intermediate
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, separate)


def test_beyond_decode_the_gemms_read_quantised_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    m = triton_experts.QUANTIZE_ON_LOAD_MAX_TOKENS + 1
    _, passes = _run_counting_quantise_passes(monkeypatch, CASES["awkward"], m, None, False)
    assert passes == 2
