"""`kernels.routing.route` as one Triton kernel: router logits [M, E] -> top-k ids and weights.

Why: the torch path is about a dozen small kernels and a stable sort over [M, E] (its sorts and
top-k alone a visible share of a prefill forward with E = 256 in a profile of the layer); this
is one launch, one program per row, so batch invariant, and host-sync free.

Same choice as the torch path: floats ranked through int32 keys in the stable sort's order
(ties to the lower expert and group; -0.0 == 0.0; NaN first), k rounds of max-then-lowest-index.
On CUDA, sigmoid is 1 / (1 + expf(-x)) with libdevice's expf and IEEE division, as torch's:
ids exactly torch's, weights to an ulp (the renormalising sum's order). Softmax sums run in
another order than torch's: scores an ulp off, ids differ only at such near-ties. A NaN logit
with its sign bit set is ranked first, torch's CUDA sort ranks it last (softmax_after_topk).
The CPU interpreter has no libdevice: numpy's exp there (kernels/triton_math.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import GroupScore, RoutingConfig, Scoring
from .dependent_launch import begin, dependent_launch
from .tensors import Routing
from .triton_math import exp, interpreted, libdevice_here


@triton.jit
def _key(v):
    """float32 -> int32 in the descending stable sort's order: NaN largest, -0.0 as 0.0."""
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(v == 0.0, 0, key)
    return tl.where(v != v, 0x7FFFFFFF, key)


@triton.jit
def _value(key):
    """_key's inverse (for keys of floats)."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, valid_ptr, ids_ptr, weights_ptr, m, stride_m, scale,
    G: tl.constexpr, S: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr,
    TOP_K: tl.constexpr, KP: tl.constexpr, TOPK_GROUPS: tl.constexpr, ROWS: tl.constexpr,
    SIGMOID: tl.constexpr, AFTER_TOPK: tl.constexpr, HAS_BIAS: tl.constexpr,
    LIMIT_GROUPS: tl.constexpr, TOP2_SUM: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_VALID: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    begin(PDL)  # kernels/dependent_launch.py
    # ROWS rows a program, each as [G, S] (groups x experts of a group) padded to [GP, SP]:
    # [ROWS, GP, SP] tensors, every reduction within a row.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    g = tl.arange(0, GP)[None, :, None]
    s = tl.arange(0, SP)[None, None, :]
    real = (g < G) & (s < S)
    expert = tl.where(real, g * S + s, G * S)  # padding: an id no expert has
    none = -0x7FFFFFFF  # below every float's key (-inf's is -0x7F800001): padding, or taken
    neg_inf = -0x7F800001  # _key(-inf)
    here = real & (rows[:, None, None] < m)
    x = tl.load(logits_ptr + rows[:, None, None] * stride_m + expert, mask=here, other=0.0)
    x = x.to(tl.float32)

    if AFTER_TOPK:  # choose on the logits; softmax over the k afterwards
        score = x
        choice = x
    else:
        if SIGMOID:
            one = tl.full((ROWS, GP, SP), 1.0, tl.float32)
            score = tl.math.div_rn(one, 1.0 + exp(-x, LIBDEVICE))
        else:
            top = tl.max(tl.max(tl.where(real, x, float("-inf")), axis=2), axis=1)
            z = tl.where(real, exp(x - top[:, None, None], LIBDEVICE), 0.0)
            total = tl.sum(tl.sum(z, axis=2), axis=1)
            score = tl.math.div_rn(z, total[:, None, None])
        choice = score
        if HAS_BIAS:
            choice = score + tl.load(bias_ptr + expert, mask=real, other=0.0).to(tl.float32)
    key = tl.where(real, _key(choice), none)

    if LIMIT_GROUPS:  # keep the TOPK_GROUPS best groups, the others' experts -inf (choosable)
        first = tl.max(key, axis=2)
        if TOP2_SUM and S > 1:
            at = tl.min(tl.where(key == first[:, :, None], s, SP), axis=2)  # its lowest s
            second = tl.max(tl.where(s == at[:, :, None], none, key), axis=2)
            group_score = _value(first) + _value(second)
        else:
            group_score = _value(first)
        gi = tl.arange(0, GP)[None, :]
        gkey = tl.where(gi < G, _key(group_score), none)
        keep = tl.zeros((ROWS, GP), tl.int32)
        for _ in range(TOPK_GROUPS):
            best = tl.max(gkey, axis=1)
            pick = tl.min(tl.where(gkey == best[:, None], gi, GP), axis=1)
            keep = tl.where(gi == pick[:, None], 1, keep)
            gkey = tl.where(gi == pick[:, None], none, gkey)
        key = tl.where(real & (keep[:, :, None] == 0), neg_inf, key)

    kr = tl.arange(0, KP)[None, :]
    ids = tl.zeros((ROWS, KP), tl.int32)
    vals = tl.zeros((ROWS, KP), tl.float32)
    for r in range(TOP_K):  # the largest key left, the lowest expert among equals
        best = tl.max(tl.max(key, axis=2), axis=1)
        pick = tl.min(tl.min(tl.where(key == best[:, None, None], expert, G * S), axis=2), axis=1)
        hit = expert == pick[:, None, None]
        key = tl.where(hit, none, key)
        if AFTER_TOPK:
            val = _value(best)  # the logit itself (NaN and -0.0 made canonical)
        else:  # the uncorrected score: x + 0 == x, NaN and inf included
            val = tl.sum(tl.sum(tl.where(hit, score, 0.0), axis=2), axis=1)
        ids = tl.where(kr == r, pick[:, None], ids)
        vals = tl.where(kr == r, val[:, None], vals)

    valid = kr < TOP_K
    if AFTER_TOPK:
        top = tl.max(tl.where(valid, vals, float("-inf")), axis=1)
        z = tl.where(valid, exp(vals - top[:, None], LIBDEVICE), 0.0)
        w = tl.math.div_rn(z, tl.sum(z, axis=1)[:, None])
    else:
        w = vals
        if RENORMALIZE:
            total = tl.sum(tl.where(valid, vals, 0.0), axis=1)
            total = tl.where(total < 1e-20, 1e-20, total)  # clamp_min, NaN kept
            w = tl.math.div_rn(w, total[:, None])
    if HAS_VALID:  # a CUDA graph's padding rows are routed nowhere
        ids = tl.where(rows[:, None] < tl.load(valid_ptr), ids, -1)
    out = rows[:, None] * TOP_K + kr
    done = valid & (rows[:, None] < m)
    tl.store(ids_ptr + out, ids, mask=done)
    tl.store(weights_ptr + out, w * scale, mask=done)


def _rows_per_program(m: int, block: int, on_gpu: bool) -> int:
    """One row a program on a GPU; the interpreter pays per operation, so it takes many."""
    if on_gpu and not interpreted():
        return 1
    return min(triton.next_power_of_2(m), max(1, 4096 // block))


def _num_warps(elements: int) -> int:
    """One warp per 1024 values of a program's block, at most 8."""
    return max(1, min(8, elements // 1024))


def route_rows(
    logits: torch.Tensor,
    cfg: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
    valid_rows: torch.Tensor | None = None,
) -> Routing:
    """`kernels.routing.route` in one launch: logits [M, E] (float32, bfloat16 or float16;
    + bias [E]) -> Routing(topk_ids int32 [M, k], topk_weights float32 [M, k]); rows from
    `valid_rows` (a 0-d int64 tensor on the device) on get ids of -1, as `mask_rows` sets them.

    No host sync: shapes alone decide what runs, so it can be captured in a CUDA graph. On a
    CPU tensor it runs only under Triton's interpreter (TRITON_INTERPRET=1)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [M, E], got {tuple(logits.shape)}")
    m, e = logits.shape
    if cfg.top_k > e:
        raise ValueError(f"top_k={cfg.top_k} exceeds the {e} experts")
    if e % cfg.num_groups:
        raise ValueError(f"{e} experts do not split into num_groups={cfg.num_groups}")
    ids = torch.empty((m, cfg.top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((m, cfg.top_k), dtype=torch.float32, device=logits.device)
    if m == 0:
        return Routing(ids, weights)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    bias = None if correction_bias is None else correction_bias.contiguous()
    after = cfg.softmax_after_topk
    size = e // cfg.num_groups
    block = triton.next_power_of_2(cfg.num_groups) * triton.next_power_of_2(size)
    rows = _rows_per_program(m, block, logits.is_cuda)
    pdl = dependent_launch(logits.device)
    _route_kernel[(triton.cdiv(m, rows),)](
        logits, bias, valid_rows, ids, weights, m, logits.stride(0),
        float(cfg.routed_scaling_factor),
        G=cfg.num_groups, S=size,
        GP=triton.next_power_of_2(cfg.num_groups), SP=triton.next_power_of_2(size),
        TOP_K=cfg.top_k, KP=triton.next_power_of_2(cfg.top_k), TOPK_GROUPS=cfg.topk_groups,
        ROWS=rows,
        SIGMOID=cfg.scoring == Scoring.SIGMOID, AFTER_TOPK=after,
        HAS_BIAS=bias is not None and not after,
        LIMIT_GROUPS=cfg.num_groups > 1 and not after,
        TOP2_SUM=cfg.group_score == GroupScore.TOP2_SUM,
        RENORMALIZE=cfg.renormalize, HAS_VALID=valid_rows is not None,
        LIBDEVICE=libdevice_here(logits.is_cuda), PDL=pdl,
        num_warps=_num_warps(block * rows), launch_pdl=pdl,
    )  # fmt: skip
    return Routing(ids, weights)
