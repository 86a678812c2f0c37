"""The Triton passes around DeepGEMM's GEMMs against their torch twins and the reference's
quantiser: GEMM1's fused epilogue (bias + activation + fp8 1x128 quantisation, MN-major scales)
and the device-built psum contiguous layout with its gather and weighted sum. On the CPU they run
in Triton's interpreter (fp16/fp32 inputs); on a GPU in bf16 too."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moe_serve.kernels.config import Activation, ActivationSpec, GateUp
from moe_serve.kernels.experts._triton import psum_layout as psum
from moe_serve.kernels.experts._triton.act_quant import (
    MaskedRows,
    PairRows,
    _round_to_e4m3,
    act_quant,
    act_quant_torch,
    mn_major_scales,
)
from moe_serve.kernels.quant_scheme import FP8, ActQuant
from moe_serve.kernels.quantize import dequantize_activation, quantize_activation

SPECS = [ActivationSpec(kind, gate_up) for kind in Activation for gate_up in GateUp]


def _dtypes(device: torch.device) -> list[torch.dtype]:
    return [torch.float16, torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])


def _run_both(h, bias, spec, rows, out_rows: int, inter: int, batch: int = 0):
    """(q bytes, scales) from the kernel and from the twin, on buffers that start as 0xFF."""
    results = []
    groups = -(-inter // 128)
    for fn in (act_quant, act_quant_torch):
        shape = (batch, out_rows, inter) if batch else (out_rows, inter)
        q = torch.full(shape, 0xFF, dtype=torch.uint8, device=h.device).view(FP8)
        s = mn_major_scales(out_rows, groups, h.device, batch).fill_(-1.0)
        fn(h, bias, spec, rows, q, s)
        results.append((q.view(torch.uint8), s))
    return results


def _assert_same(kernel, twin) -> None:
    (qk, sk), (qt, st) = kernel, twin
    torch.testing.assert_close(sk, st, rtol=1e-6, atol=0)  # a few float32 roundings apart
    # the twin divides by 448 exactly where the kernel multiplies by its reciprocal (torch's CUDA
    # rule), and the interpreter's transcendental functions are numpy's: a value on a rounding
    # boundary may land one fp8 step away, nothing more, and rarely
    differ = qk != qt
    got, want = qk[differ].view(FP8).float(), qt[differ].view(FP8).float()
    assert torch.all((got - want).abs() <= want.abs() / 8 + 2.0**-9)
    # Bytes differ only with values, or as a zero's sign: where erf saturates at -1, the twin's
    # GELU (torch's vectorised CPU code on an AVX2 host without AVX-512) returns +0.0 where
    # IEEE arithmetic, CUDA and the kernel give -0.0. Rounding keeps the sign of zero bit for
    # bit: test_round_to_e4m3_is_torchs_cast_bit_for_bit.
    assert torch.all((got != want) | (want == 0))
    assert (got != want).sum() < 1e-3 * qk.numel()  # values one step apart: rare


@triton.jit
def _round_kernel(x_ptr, q_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    q = _round_to_e4m3(x).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(q_ptr + offs, q, mask=offs < n)


def test_round_to_e4m3_is_torchs_cast_bit_for_bit(device: torch.device) -> None:
    """Every fp8 value, every midpoint (ties to even) and a float32 step either side of it, and
    values that round to zero: the same bytes as torch's cast, the sign of zero included."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()  # ascending, -448..448, one zero
    mid = (grid[1:] + grid[:-1]) / 2
    step = torch.finfo(torch.float32).eps * mid.abs()
    tiny = torch.tensor([2.0**-10, 2.0**-11, 1e-6, 1e-30, 0.0])
    x = torch.cat((grid, mid, mid - step, mid + step, tiny, -tiny)).to(device)
    q = torch.empty(x.numel(), dtype=torch.uint8, device=device)
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, q, x.numel(), BLOCK=256)
    want = x.to(FP8).view(torch.uint8)
    assert torch.equal(q, want), x[q != want]
    assert torch.all(want[x.numel() - 5 :] == 0x80)  # the negative zeros


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.gate_up}")
@pytest.mark.parametrize(("rows", "inter"), [(1, 128), (37, 200), (5, 640)])
def test_act_quant_pairs_match_the_twin(
    device: torch.device, spec: ActivationSpec, rows: int, inter: int
) -> None:
    g = torch.Generator(device=device).manual_seed(rows + inter)
    experts = 3
    pairs = 2 * rows
    for dtype in _dtypes(device):
        h = (torch.randn(rows + 3, 2 * inter, generator=g, device=device) * 4).to(dtype)
        bias = torch.randn(experts, 2 * inter, generator=g, device=device)
        pair_row = torch.randperm(rows + 3, generator=g, device=device)[:pairs].int()
        pair_row = torch.cat((pair_row, torch.full((pairs - pair_row.numel(),), -1, device=device)))
        pair_row[::4] = -1  # pairs of other ranks: their rows stay untouched
        ids = torch.randint(0, experts, (pairs,), generator=g, device=device).int()
        for b in (None, bias):
            kernel, twin = _run_both(h, b, spec, PairRows(pair_row.int(), ids), rows + 3, inter)
            _assert_same(kernel, twin)
            untouched = torch.ones(rows + 3, dtype=torch.bool, device=device)
            untouched[pair_row[pair_row >= 0].long()] = False
            assert torch.all(kernel[0][untouched] == 0xFF) and torch.all(kernel[1][untouched] == -1)


@pytest.mark.parametrize("spec", SPECS[:2] + SPECS[-2:], ids=lambda s: f"{s.kind}-{s.gate_up}")
def test_act_quant_masked_rows_match_the_twin(device: torch.device, spec: ActivationSpec) -> None:
    g = torch.Generator(device=device).manual_seed(1)
    experts, max_m, max_tokens, inter = 4, 16, 5, 256
    counts = torch.tensor([0, 5, 1, 3], dtype=torch.int32, device=device)  # an empty expert
    for dtype in _dtypes(device):
        h = torch.randn(experts, max_m, 2 * inter, generator=g, device=device).to(dtype)
        bias = torch.randn(experts, 2 * inter, generator=g, device=device)
        rows = MaskedRows(counts, max_tokens)
        kernel, twin = _run_both(h, bias, spec, rows, max_m, inter, batch=experts)
        _assert_same(kernel, twin)
        assert torch.all(kernel[0][0] == 0xFF) and torch.all(kernel[0][:, max_tokens:] == 0xFF)


def test_act_quant_is_the_reference_quantiser_of_the_reference_activation(
    device: torch.device,
) -> None:
    """Dequantised, the kernel's rows are the reference's fp8 1x128 rounding of act(h + b)."""
    g = torch.Generator(device=device).manual_seed(2)
    spec = ActivationSpec(Activation.SILU)
    h = torch.randn(9, 2 * 384, generator=g, device=device) * 10
    h[3] = 0  # an all-zero row keeps a finite scale
    h[4, :128] = 1e-6  # values in fp8's subnormal range
    rows = PairRows(
        torch.arange(9, dtype=torch.int32, device=device), torch.zeros(9).int().to(device)
    )
    q = torch.empty(9, 384, dtype=FP8, device=device)
    s = mn_major_scales(9, 3, device)
    act_quant(h, None, spec, rows, q, s)
    gate, up = h.chunk(2, dim=-1)
    want_q, want_s = quantize_activation(torch.nn.functional.silu(gate) * up, ActQuant.GROUP)
    torch.testing.assert_close(s, want_s, rtol=2e-7, atol=0)
    torch.testing.assert_close(
        dequantize_activation(q, s.contiguous(), ActQuant.GROUP),
        dequantize_activation(want_q, want_s, ActQuant.GROUP),
        rtol=0.13,  # one fp8 step where a value sits on a rounding boundary
        atol=0,
    )
    assert torch.all(q[3].float() == 0) and torch.isfinite(s).all()


# ---- the psum contiguous layout -----------------------------------------------------------


def _ids(case: str, m: int, num_experts: int, k: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(m)])
    if case == "all_to_one_expert":
        ids = torch.stack((torch.full((m,), 4), torch.full((m,), -1)), 1)
    if case == "empty_experts":
        ids = ids % 2
    if case == "ids_not_here":
        ids[::3, 0] = -1
    return ids.int().to(device)


@pytest.mark.parametrize("case", ["random", "all_to_one_expert", "empty_experts", "ids_not_here"])
@pytest.mark.parametrize("m", [1, 37, 2100])  # 2100 x 2 pairs: the three-kernel path
def test_psum_layout_matches_the_twin(device: torch.device, case: str, m: int) -> None:
    num_experts, k, align = 6, 2, 8
    ids = _ids(case, m, num_experts, k, device)
    got = psum.psum_layout(ids, num_experts, align)
    want = psum.psum_layout_torch(ids, num_experts, align)
    assert got.capacity == want.capacity
    assert torch.equal(got.psum, want.psum)
    flat = ids.flatten()
    assert torch.equal(got.pair_row < 0, flat < 0)
    if m < 2100:
        assert torch.equal(got.pair_row, want.pair_row)  # one program: pairs in id order
    for e in range(num_experts):  # atomics: any order within the expert's run, the same rows
        mine = flat == e
        assert torch.equal(got.pair_row[mine].sort().values, want.pair_row[mine].sort().values)
    end = 0
    for e, stop in enumerate(want.psum.tolist()):  # runs start aligned and hold their pairs
        start = -(-end // align) * align
        rows = want.pair_row[flat == e]
        assert stop - start == rows.numel() and (rows.numel() == 0 or rows.min() == start)
        end = stop
    assert end <= want.capacity


def test_gather_and_weighted_sum_move_each_pair_to_its_row_and_back(device: torch.device) -> None:
    num_experts, k, align, m, hidden = 5, 3, 8, 11, 384
    ids = _ids("ids_not_here", m, num_experts, k, device)
    layout = psum.psum_layout(ids, num_experts, align)
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(m, hidden, generator=g, device=device).to(FP8)
    x_scale = torch.rand(m, 3, generator=g, device=device)
    a = torch.zeros(layout.capacity, hidden, dtype=FP8, device=device)
    a_scale = mn_major_scales(layout.capacity, 3, device).zero_()
    psum.gather_rows(x, x_scale, layout, a, a_scale)
    here = layout.pair_row >= 0
    rows, tokens = layout.pair_row[here].long(), torch.arange(m * k, device=device)[here] // k
    assert torch.equal(a.view(torch.uint8)[rows], x.view(torch.uint8)[tokens])
    assert torch.equal(a_scale[rows], x_scale[tokens])

    y = torch.randn(layout.capacity, hidden, generator=g, device=device).half()
    bias = torch.randn(num_experts, hidden, generator=g, device=device)
    weights = torch.rand(m, k, generator=g, device=device)
    out = psum.weighted_sum(y, bias, layout, ids, weights, torch.empty(m, hidden, device=device))
    y_rows = y.float()[layout.pair_row.long().clamp(min=0)]
    pairs = y_rows + bias[ids.flatten().long().clamp(min=0)]
    pairs = pairs * torch.where(ids >= 0, weights, 0).flatten()[:, None]
    torch.testing.assert_close(out, pairs.view(m, k, hidden).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("spec", "inter", "bias"),
    [
        (ActivationSpec(Activation.SILU), 2048, False),  # DeepSeek-V3
        (ActivationSpec(Activation.SWIGLUOAI, GateUp.INTERLEAVED), 2880, True),  # gpt-oss
    ],
)
def test_act_quant_on_the_gpu_in_bf16_at_full_size(
    spec: ActivationSpec, inter: int, bias: bool
) -> None:
    cuda = torch.device("cuda")
    g = torch.Generator(device=cuda).manual_seed(4)
    rows, experts = 333, 8
    h = (torch.randn(rows, 2 * inter, generator=g, device=cuda) * 3).bfloat16()
    b = torch.randn(experts, 2 * inter, generator=g, device=cuda) if bias else None
    pair_row = torch.randperm(rows, generator=g, device=cuda).int()
    pair_row[::5] = -1
    ids = torch.randint(0, experts, (rows,), generator=g, device=cuda).int()
    _assert_same(*_run_both(h, b, spec, PairRows(pair_row, ids), rows, inter))
    counts = torch.randint(0, 9, (experts,), generator=g, device=cuda).int()
    h3 = h[:256].view(experts, 32, 2 * inter)
    _assert_same(*_run_both(h3, b, spec, MaskedRows(counts, 8), 32, inter, batch=experts))
