"""A float64 per-token loop over the original math: the truth the backends are held to.

Schemes that quantise activations to fp8 round twice (the input and the intermediate). Where a
value sits so close to a rounding midpoint that float32 and float64 arithmetic may round it
differently, its token is marked *ambiguous*: tests check those tokens against a loose bound
(one fp8 step) and every other token strictly. Small intermediates computed by cancellation
carry float32 errors far above their own precision and can still flip undetected: use
`FP8_ACT_TOL` rather than 1e-5 for schemes that quantise activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_serve.kernels.config import Activation, MoEConfig
from moe_serve.kernels.quantize import dequantize_activation, dequantize_weight, quantize_activation
from moe_serve.kernels.tensors import ExpertWeights, Routing

_NUDGE = 1e-5  # relative wiggle under which float32 and float64 paths may round differently
FP8_ACT_TOL = 5e-5  # worst seen over 900 random fp8 cases: 1.9e-5


@dataclass
class Oracle:
    output: torch.Tensor  # [M, H] float64
    ambiguous: torch.Tensor  # [M] bool: an fp8 rounding of this token is a coin toss


def _activation(v: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    spec = cfg.activation
    if spec.gate_up == "interleaved":
        gate, up = v[0::2], v[1::2]
    else:
        gate, up = v[: v.numel() // 2], v[v.numel() // 2 :]
    if spec.kind == Activation.SILU:
        return gate / (1 + torch.exp(-gate)) * up
    if spec.kind == Activation.GELU:
        return 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2))) * up
    gate, up = gate.clamp(max=spec.limit), up.clamp(-spec.limit, spec.limit)
    return (up + 1) * gate / (1 + torch.exp(-spec.alpha * gate))


def _fp8_round_trip(x: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [R, C] through the scheme's activation quantisation -> (values, ambiguous [R])."""
    how = cfg.quant.spec.act_quant
    if how is None or x.numel() == 0:
        return x, torch.zeros(x.shape[0], dtype=torch.bool)

    q, scale = quantize_activation(x.float(), how)
    values = dequantize_activation(q, scale, how).double()
    step = dequantize_activation(torch.ones_like(q, dtype=torch.float32).to(q.dtype), scale, how)
    scaled = x / step.double()  # what was rounded to fp8

    def fp8(v: torch.Tensor) -> torch.Tensor:
        return v.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()

    ambiguous = (fp8(scaled * (1 + _NUDGE)) != fp8(scaled * (1 - _NUDGE))).any(dim=1)
    return values, ambiguous


def moe_oracle(
    cfg: MoEConfig,
    weights: ExpertWeights,
    hidden: torch.Tensor,
    routing: Routing,
    expert_map: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> Oracle:
    """hidden [M, H] -> float64 [M, H], one (token, slot) at a time. `weights` hold every expert;
    `expert_map` keeps only this rank's. Dynamic activation scales are taken per chunk of
    `chunk_tokens` tokens, as a chunking kernel takes them."""
    step = chunk_tokens or max(hidden.shape[0], 1)
    parts = [
        _oracle_chunk(cfg, weights, hidden[s : s + step], _rows(routing, s, step), expert_map)
        for s in range(0, hidden.shape[0], step)
    ]
    if not parts:
        return Oracle(
            torch.zeros(hidden.shape, dtype=torch.float64), torch.zeros(0, dtype=torch.bool)
        )
    return Oracle(torch.cat([p.output for p in parts]), torch.cat([p.ambiguous for p in parts]))


def _rows(routing: Routing, start: int, count: int) -> Routing:
    rows = slice(start, start + count)
    return Routing(routing.topk_ids[rows], routing.topk_weights[rows])


def _oracle_chunk(
    cfg: MoEConfig,
    weights: ExpertWeights,
    hidden: torch.Tensor,
    routing: Routing,
    expert_map: torch.Tensor | None,
) -> Oracle:
    w13 = dequantize_weight(weights.w13, weights.w13_scale, cfg.quant, cfg.w13_parts).double()
    w2 = dequantize_weight(weights.w2, weights.w2_scale, cfg.quant).double()
    x, ambiguous = _fp8_round_trip(hidden.double(), cfg)
    pairs, intermediates = [], []
    for t in range(hidden.shape[0]):
        for j in range(routing.topk_ids.shape[1]):
            e = int(routing.topk_ids[t, j])
            if expert_map is not None and int(expert_map[e]) < 0:
                continue  # another rank's expert
            g = w13[e] @ x[t]
            if weights.w13_bias is not None:
                g = g + weights.w13_bias[e].double()
            pairs.append((t, j, e))
            intermediates.append(_activation(g, cfg))
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    if not pairs:
        return Oracle(out, ambiguous)
    # the fast paths quantise the intermediates of all pairs at once
    h, pair_ambiguous = _fp8_round_trip(torch.stack(intermediates), cfg)
    for (t, j, e), h_p, amb in zip(pairs, h, pair_ambiguous, strict=True):
        y = w2[e] @ h_p
        if weights.w2_bias is not None:
            y = y + weights.w2_bias[e].double()
        out[t] += float(routing.topk_weights[t, j]) * y
        ambiguous[t] |= bool(amb)
    return Oracle(out, ambiguous)


def assert_matches(actual: torch.Tensor, oracle: Oracle, tol: float, loose: float = 0.15) -> None:
    """Relative error below `tol` over the unambiguous tokens, below `loose` on the others."""
    from moe_serve.kernels.accuracy import relative_error

    clear = ~oracle.ambiguous
    assert clear.float().mean() >= 0.75, "too many ambiguous tokens for a meaningful check"
    err = relative_error(actual[clear], oracle.output[clear])
    assert err < tol, f"relative error {err:.3g} >= {tol:g} on {int(clear.sum())} tokens"
    if oracle.ambiguous.any():
        loose_err = relative_error(actual[oracle.ambiguous], oracle.output[oracle.ambiguous])
        assert loose_err < loose, f"ambiguous tokens: relative error {loose_err:.3g}"
