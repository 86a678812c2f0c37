"""Each external backend against its library called alone on the same inputs (the target: within
TARGET_RATIO at every M): `moe-serve bench kernels --mode external-alone`.

Per shape (DeepSeek-V3 for the DeepGEMM backends, gpt-oss for the triton_kernels ones) and token
count, on one routing: the backend's modular forward (prepare, experts, finalize; routing
excluded) and the library alone, whose inputs are laid out before the timing:
- deep-gemm: DeepGEMM's two contiguous grouped GEMMs on a tight m_indices layout (fp8 inputs
  and MN-major scales ready), GEMM2's input ready too;
- deep-gemm-batched: its two masked GEMMs on [E, max_m, K] inputs;
- oai-triton*: the two matmul_ogs calls on routing objects made beforehand.
Each is timed uncaptured and captured in a CUDA graph (replay), L2 flushed before every
iteration, medians (kernels/timing.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from ..kernels.arith import ceil_div, round_up
from ..kernels.experts.deep_gemm import MASKED_M_ALIGNMENT
from ..kernels.experts.oai_triton import ogs_routing
from ..kernels.graph_capture import replay_of
from ..kernels.layer import build_layer
from ..kernels.layer_graphs import kernel_can_capture
from ..kernels.quant_scheme import FP8_BLOCK, ActQuant
from ..kernels.quantize import quantize_activation
from ..kernels.routing import route
from ..kernels.tensors import Routing
from ..kernels.timing import Timer, TimingPlan
from ..kernels.workspace import Workspace
from .random_layer import random_layer
from .router_loads import Load, router_logits
from .schema import Environment, write_result
from .shapes import SHAPES

log = logging.getLogger(__name__)
CUDA = torch.device("cuda")
BACKENDS = {
    "deepseek-v3": ("deep-gemm", "deep-gemm-batched"),
    "gpt-oss": ("oai-triton", "oai-triton-unfused"),
}
TARGET_RATIO = 1.15


def _mn_major(rows_scale: torch.Tensor) -> torch.Tensor:
    """[..., R, G] float32 -> the same values stored MN-major (what the experts write)."""
    return rows_scale.transpose(-1, -2).contiguous().transpose(-1, -2)


def deep_gemm_alone(experts, hidden: torch.Tensor, topk_ids: torch.Tensor) -> Callable:
    """DeepGEMM's two contiguous GEMMs, layouts and GEMM2's input made here (m_indices)."""
    dg, cfg = experts.dg, experts.cfg
    align = dg.get_mk_alignment_for_contiguous_layout()
    flat = topk_ids.flatten().long()
    counts = torch.bincount(flat, minlength=cfg.num_experts)
    padded = (counts + align - 1) // align * align
    m_pad = int(padded.sum())
    m_indices = torch.full((m_pad,), -1, dtype=torch.int32, device=CUDA)  # -1: padding
    start = padded.cumsum(0) - padded
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(flat.numel(), device=CUDA) - (counts.cumsum(0) - counts)[flat[order]]
    m_indices[start[flat[order]] + rank] = flat[order].int()
    rows = torch.zeros(m_pad, cfg.hidden_size, device=CUDA, dtype=torch.bfloat16)
    rows[start[flat[order]] + rank] = hidden[order // topk_ids.shape[1]]
    a, a_scale = quantize_activation(rows, ActQuant.GROUP)
    inter = torch.randn(m_pad, cfg.intermediate_size, device=CUDA)
    q, q_scale = quantize_activation(inter, ActQuant.GROUP)
    a_scale, q_scale = _mn_major(a_scale), _mn_major(q_scale)
    h13 = torch.empty(m_pad, 2 * cfg.intermediate_size, device=CUDA, dtype=torch.bfloat16)
    y = torch.empty(m_pad, cfg.hidden_size, device=CUDA, dtype=torch.bfloat16)

    def run() -> None:
        dg.m_grouped_fp8_gemm_nt_contiguous((a, a_scale), experts.w13(), h13, m_indices)
        dg.m_grouped_fp8_gemm_nt_contiguous((q, q_scale), experts.w2(), y, m_indices)

    return run


def deep_gemm_masked_alone(experts, topk_ids: torch.Tensor) -> Callable:
    """DeepGEMM's two masked GEMMs on [E, max_m, K] inputs made here."""
    dg, cfg = experts.dg, experts.cfg
    e = cfg.num_experts
    counts = torch.bincount(topk_ids.flatten().long(), minlength=e).int()
    max_m = round_up(max(int(counts.max()), 1), MASKED_M_ALIGNMENT)
    expected_m = max(1, ceil_div(topk_ids.numel(), e))

    def fp8(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(e * max_m, k, device=CUDA)
        q, s = quantize_activation(x, ActQuant.GROUP)
        return q.view(e, max_m, k), _mn_major(s.view(e, max_m, ceil_div(k, FP8_BLOCK)))

    a, q = fp8(cfg.hidden_size), fp8(cfg.intermediate_size)
    h13 = torch.empty(e, max_m, 2 * cfg.intermediate_size, device=CUDA, dtype=torch.bfloat16)
    y = torch.empty(e, max_m, cfg.hidden_size, device=CUDA, dtype=torch.bfloat16)

    def run() -> None:
        dg.m_grouped_fp8_gemm_nt_masked(a, experts.w13(), h13, counts, expected_m)
        dg.m_grouped_fp8_gemm_nt_masked(q, experts.w2(), y, counts, expected_m)

    return run


def oai_alone(experts, hidden: torch.Tensor, topk_ids, topk_weights) -> Callable:
    """triton_kernels' two matmul_ogs calls (and the unfused activation), routing made here."""
    routing = ogs_routing(topk_ids, topk_weights, experts.cfg.num_experts)
    return lambda: experts._experts(hidden, routing)


def library_alone(experts, hidden: torch.Tensor, routing) -> Callable:
    name = experts.name
    if name == "deep-gemm":
        return deep_gemm_alone(experts, hidden, routing.topk_ids)
    if name == "deep-gemm-batched":
        return deep_gemm_masked_alone(experts, routing.topk_ids)
    return oai_alone(experts, hidden, routing.topk_ids, routing.topk_weights)


def _time(timer: Timer, fn: Callable, capture: bool) -> float | None:
    """Median microseconds, or None where the call cannot be captured."""
    try:
        call = replay_of(fn) if capture else fn
        return timer.measure(call).median_us
    except Exception as err:  # a backend that syncs with the host cannot be captured
        log.warning("not timed (%s): %s", "captured" if capture else "eager", err)
        torch.cuda.synchronize()
        return None


def time_point(timer: Timer, kernel, hidden: torch.Tensor, routing: Routing) -> dict:
    """The backend's forward and its library alone, eager and captured, at one point."""
    private = Workspace(CUDA)  # a graph's buffers must not move

    def forward() -> None:
        kernel.forward(hidden, routing, workspace=private)

    alone = library_alone(kernel.experts, hidden, routing)
    capturable = kernel_can_capture(kernel, hidden.shape[0])
    row = {}
    for mode, capture in (("eager", False), ("captured", True)):
        row[f"{mode}_us"] = _time(timer, forward, capture) if capturable or not capture else None
        row[f"alone_{mode}_us"] = _time(timer, alone, capture)
        if row[f"{mode}_us"] and row[f"alone_{mode}_us"]:
            row[f"{mode}_ratio"] = row[f"{mode}_us"] / row[f"alone_{mode}_us"]
    return row


def measure(tokens: tuple[int, ...], plan: TimingPlan, only: frozenset[str]) -> list[dict]:
    """The backends of BACKENDS named in `only`, at every token count."""
    timer = Timer(CUDA, plan)
    rows = []
    for shape, names in BACKENDS.items():
        backends = [b for b in names if b in only]
        if not backends:
            continue
        cfg = SHAPES[shape]
        weights = random_layer(cfg, CUDA, seed=0)
        max_m = max(tokens)
        hidden_all = torch.randn(max_m, cfg.hidden_size, device=CUDA).to(cfg.dtype)
        logits = router_logits(Load.UNIFORM, max_m, cfg.num_experts, 2, CUDA)
        routing_all = route(logits, cfg.routing, weights.router.correction_bias)
        for backend in backends:
            layer, _ = build_layer(cfg, weights, CUDA, backend=backend, chunk_tokens=max_m)
            for m in tokens:
                routing = Routing(routing_all.topk_ids[:m], routing_all.topk_weights[:m])
                point = time_point(timer, layer.kernel, hidden_all[:m], routing)
                rows.append({"shape": shape, "backend": backend, "tokens": m} | point)
                log.info("%s", rows[-1])
            del layer
            torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()
    return rows


def render(result: dict) -> str:
    env = Environment.model_validate(result["environment"])

    def us(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}" + ("" if v <= TARGET_RATIO else " !")

    lines = [
        f"# External backends against their libraries alone: {env.device}, commit {env.commit}",
        "",
        "| shape | backend | M | eager us | alone eager | ratio | captured us | alone captured"
        " | ratio |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['shape']} | {r['backend']} | {r['tokens']} | {us(r['eager_us'])} | "
            f"{us(r['alone_eager_us'])} | {ratio(r.get('eager_ratio'))} | "
            f"{us(r['captured_us'])} | {us(r['alone_captured_us'])} | "
            f"{ratio(r.get('captured_ratio'))} |"
        )
    return "\n".join(lines) + f"\n\n`!`: above the {TARGET_RATIO}x target.\n"


def run(
    tokens: tuple[int, ...], plan: TimingPlan, only: frozenset[str], env: Environment, path: Path
) -> dict:
    """The backends of BACKENDS named in `only`; writes `path` and its .md."""
    unknown = only - {b for names in BACKENDS.values() for b in names}
    if unknown:
        known = ", ".join(b for names in BACKENDS.values() for b in names)
        raise ValueError(f"unknown external backends {sorted(unknown)}; known: {known}")
    if not torch.cuda.is_available():
        raise ValueError("the external libraries run on a CUDA GPU; none is visible here")
    with torch.inference_mode():
        rows = measure(tokens, plan, only)
    result = {"environment": env.model_dump(), "rows": rows}
    write_result(path, result, render(result))
    return result
