"""kernels/row_kernels.py's Triton kernels on their own: in the interpreter on the CPU,
compiled on a GPU (the gpu-marked cases). Their callers' tests: test_input_checks.py (the finite
flag against isfinite) and test_layer_graphs_gpu.py (graphs of padded batches)."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.batch_invariant import triton_matmul
from moe_serve.kernels.input_checks import (
    NONFINITE_BITS,
    all_finite_on_device,
    bit_rows,
    finite_flag,
)
from moe_serve.kernels.layer import ROUTER_GEMV_TOKENS, RouterWeights, expert_tokens
from moe_serve.kernels.layer_graphs import zero_padding
from moe_serve.kernels.routing import mask_rows
from moe_serve.kernels.row_kernels import (
    batch_stats_into,
    nonfinite_into,
    router_logits_into,
    silu_and_mul,
    zero_rows_from,
)
from moe_serve.kernels.tensors import ForwardInputs

_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("device", _DEVICES)
def test_the_triton_finite_kernel_reads_the_bits_of_every_row_before_valid_rows(
    device: str, dtype: torch.dtype
) -> None:
    """The kernel itself (Triton's interpreter on the CPU, compiled on a GPU): a NaN or Inf in
    a checked row sets the flag, one in a row from valid_rows on does not; finite values of
    every magnitude (the largest, subnormals, negative zero) never do."""
    finfo = torch.finfo(dtype)
    t = torch.tensor([[finfo.max, -finfo.max, finfo.tiny / 2, -0.0]] * 3).to(dtype).to(device)
    bits_dtype, mask = NONFINITE_BITS[dtype]

    def flag(x: torch.Tensor, valid: int | None) -> int:
        out = torch.zeros(1, dtype=torch.int32, device=device)
        valid_rows = None if valid is None else torch.tensor(valid, device=device)
        nonfinite_into(x.view(bits_dtype), mask, out, valid_rows)
        return int(out)

    assert flag(t, None) == 0
    t[2, 1] = float("nan")
    assert flag(t, None) == 1
    assert flag(t, 2) == 0
    assert flag(t, 3) == 1


@pytest.mark.parametrize("shape", [(1, 7168), (6, 3), (5, 1500), (0, 64)])
@pytest.mark.parametrize("valid", [0, 1, 4, 9])
@pytest.mark.parametrize("device", _DEVICES)
def test_rows_from_valid_rows_on_are_zeroed_and_the_others_left_as_they_were(
    device: str, shape: tuple[int, int], valid: int
) -> None:
    """A graph's padding rows (from valid_rows on) zeroed in place, the kernel against the
    masked_fill of the fallback; rows before valid_rows keep their bits, NaN included."""
    x = torch.randn(shape, dtype=torch.float16).to(device)
    if x.numel():
        x[0, 0] = float("nan")
    before = x.clone()
    valid_rows = torch.tensor(valid, device=device)
    assert zero_rows_from(x, valid_rows) is x
    kept = min(valid, shape[0])
    assert torch.equal(x[:kept].view(torch.int16), before[:kept].view(torch.int16))
    assert not x[kept:].view(torch.int16).any()
    fallback = zero_padding(before.cpu(), valid_rows.cpu())
    assert torch.equal(x.cpu().view(torch.int16), fallback.view(torch.int16))


@pytest.mark.parametrize("shape", [(1, 7168), (5, 1500), (0, 64)])
@pytest.mark.parametrize("num_experts", [4, 256, 1500])
@pytest.mark.parametrize("device", _DEVICES)
def test_the_replays_first_kernel_resets_the_stats_as_it_zeroes_the_padding(
    device: str, shape: tuple[int, int], num_experts: int
) -> None:
    """Whatever a replay's stats held, they start over as the stats pass expects (no tokens
    per expert, both flags up), also past one block of the kernel and with no rows at all; the
    padding is zeroed as without them."""
    x = torch.randn(shape, dtype=torch.float16).to(device)
    before = x.clone()
    valid_rows = torch.tensor(1, device=device)
    stats = torch.randint(-9, 9, (num_experts + 2,), device=device)
    zero_rows_from(x, valid_rows, stats)
    assert stats.tolist() == [0] * num_experts + [1, 1]
    want = zero_padding(before.cpu(), valid_rows.cpu())
    assert torch.equal(x.cpu().view(torch.int16), want.view(torch.int16))
    fallback = torch.randint(-9, 9, (num_experts + 2,))
    zero_padding(before.cpu(), valid_rows.cpu(), fallback)
    assert torch.equal(fallback, stats.cpu())


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 4096), (7, 3000), (3, 2), (0, 64)])
@pytest.mark.parametrize("device", _DEVICES)
def test_silu_and_mul_rounds_once_as_torch_does(
    device: str, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    """The shared experts' activation in one pass against torch's silu, * and .to: bit for bit
    on a GPU (libdevice's expf and IEEE division, as torch's kernels); in the interpreter,
    whose exp is numpy's, within an ulp of the output. Large gates saturate (silu(x) = x),
    very negative ones vanish, and NaN and Inf pass through."""
    g = torch.Generator().manual_seed(shape[0])
    h = (torch.randn(shape[0], 2 * shape[1], generator=g) * 6).to(device)
    if h.numel():
        h[0, :4] = torch.tensor([100.0, -100.0, float("inf"), float("nan")])
    gate, up = h.chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).to(dtype)
    got = silu_and_mul(h, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    got, want = got[~nan], want[~nan]
    if device == "cuda":
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    else:
        torch.testing.assert_close(got, want, rtol=torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("m", "experts", "hidden"), [(1, 128, 2880), (2, 257, 7168), (1, 6, 33)])
@pytest.mark.parametrize("device", _DEVICES)
def test_router_logits_are_the_float32_dots_plus_the_bias(
    device: str, m: int, experts: int, hidden: int, with_bias: bool
) -> None:
    """Every logit (router rows not a multiple of a program's, H not of a step) is its row's dot
    summed in float32, to float32 rounding, against a float64 oracle; bf16 inputs."""
    g = torch.Generator().manual_seed(experts)
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16)
    w = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    bias = torch.randn(experts, generator=g) if with_bias else None
    out = torch.full((m, experts), float("nan"), device=device)
    router_logits_into(out, x.to(device), w.to(device), None if bias is None else bias.to(device))
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    scale = (x.double().abs() @ w.double().abs().T).max()
    assert (out.cpu().double() - want).abs().max() <= 1e-6 * scale


@pytest.mark.gpu
def test_the_router_of_a_token_or_two_runs_the_gemv_and_a_larger_batch_cublas() -> None:
    """The served router: up to ROUTER_GEMV_TOKENS rows through the Triton pass (the same
    logits as calling it), more through cuBLAS, and batch-invariant layers never through it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 512, generator=g).to(torch.bfloat16).cuda()
    router = RouterWeights(w, torch.randn(64, generator=g).cuda())
    x = torch.randn(ROUTER_GEMV_TOKENS + 1, 512, generator=g).to(torch.bfloat16).cuda()
    few = x[:ROUTER_GEMV_TOKENS]
    direct = router_logits_into(torch.empty(ROUTER_GEMV_TOKENS, 64, device="cuda"), few, w,
                                router.bias)  # fmt: skip
    assert torch.equal(router.logits(few), direct)
    cublas = torch.mm(x, w.T, out_dtype=torch.float32) + router.bias
    assert torch.equal(router.logits(x), cublas)
    invariant = triton_matmul(few, w) + router.bias  # one tile at every M
    assert torch.equal(router.logits(few, batch_invariant=True), invariant)


@pytest.mark.parametrize("with_logits", [False, True])
@pytest.mark.parametrize("valid", [0, 1, 5, 7])
@pytest.mark.parametrize("device", _DEVICES)
def test_batch_stats_equal_the_torch_counts_and_flags_they_replace(
    device: str, valid: int, with_logits: bool
) -> None:
    """One pass against the torch composition a graph ran before: pairs per expert over the
    valid rows (ids of -1 nowhere), the output's valid rows finite, every input row finite.
    NaN or Inf in a padded output row is not counted; in a padded input row it is. Rows of
    2100 columns: three column blocks, the bad values in the second and third."""
    rows, k, num_experts, cols = 7, 3, 10, 2100
    g = torch.Generator().manual_seed(valid)
    ids = torch.randint(-1, num_experts, (rows, k), generator=g, dtype=torch.int32).to(device)
    valid_rows = torch.tensor(valid, device=device)
    cases = {
        "finite": (None, None),
        "bad output, valid row": ((0, 2050), None),
        "bad output, padded row": ((6, 1030), None),
        "bad input, padded row": (None, 6),  # in its last column
    }
    for name, (bad_out, bad_in) in cases.items():
        out = torch.randn(rows, cols, generator=g).bfloat16().to(device)
        hidden = torch.randn(rows, cols, generator=g).bfloat16().to(device)
        logits = torch.randn(rows, num_experts, generator=g).to(device) if with_logits else None
        if bad_out:
            out[bad_out] = float("nan")
        if bad_in:
            (logits if with_logits else hidden)[bad_in, -1] = float("inf")
        stats = torch.tensor([0] * num_experts + [1, 1], device=device)
        inputs = [bit_rows(t) for t in (hidden, logits) if t is not None]
        batch_stats_into(stats, ids, valid_rows, bit_rows(out), inputs)
        counts = expert_tokens(mask_rows(ids, valid_rows), num_experts)
        finite = all_finite_on_device(out, valid_rows)
        inputs_finite = finite_flag(ForwardInputs(hidden, logits))
        want = torch.cat([counts, torch.stack([finite, inputs_finite]).long()])
        assert torch.equal(stats, want), name
