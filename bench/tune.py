"""`moe-serve bench tune` (`--mode tiles`): search tile sizes of the `triton` experts for one
layer on this GPU and write them as a tuned file, which kernels/experts/_triton/tiles.py then
prefers over its heuristic.

For each token-count bucket M it times the experts (align, both GEMMs, top-k sum; per pair, both
GEMVs; replayed from a CUDA graph, L2 flushed, median of CUDA-event timings) in rounds, each
around the best so far: a small set of candidates around the heuristic (both GEMMs alike),
GEMM2's own tile, then the program order. Decode buckets (at most 16 rows per expert, where the
GEMMs stream weights) then search each GEMM's column tile, warps and pipeline depth past the
heuristic's cap of 4 stages: there the time is how many weight bytes are in flight. Prefill
buckets (more rows per expert) search each GEMM's column tile, K step, warps and pipeline depth
within all of Hopper's shared memory, at the row tile so far and twice it: the heuristic's
budget leaves room for fewer stages than the large tiles want. Buckets of at most one row per
expert also time per-pair GEMVs (gemv.py; GEMM2 summing each token's pairs as it writes them, no
top-k sum), each GEMM's column tile, K step and warps in turn. Last, the fastest few (and, with
--retune, the bucket's current tiles) are timed again on fresh routings and the fastest on
average wins: one timing on one routing picks among tiles within noise of each other by chance,
and `bench kernels` then serves the pick slower than tiles it beat by a hair. Resumable: buckets
already in --out are kept, and the file is rewritten after each one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..kernels.config import MoEConfig, RoutingConfig
from ..kernels.quant_scheme import QuantConfig, QuantScheme

if TYPE_CHECKING:
    from ..kernels.experts._triton.tiles import LayerTiles
    from ..kernels.tensors import Dispatched

log = logging.getLogger(__name__)

# (block_n, block_k, num_warps) tried for each GEMM; stages follow from shared memory
_GEMM_CHOICES = ((64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 64, 4))
# GEMM2 alone also tries wide tiles: its K (I) is short and it keeps one accumulator
_GEMM2_CHOICES = (*_GEMM_CHOICES, (256, 64, 8), (256, 128, 8))
_GROUP_M_CHOICES = (0, 8, 16, 32)  # GemmTile.group_m, both GEMMs alike
# decode round: (block_n, num_warps, num_stages) for each GEMM in turn, where they fit
_DECODE_CHOICES = tuple(
    (n, w, s) for n in (16, 32, 64, 128) for w in (1, 2, 4) for s in (2, 3, 4, 6, 8)
)
_DECODE_ROWS_PER_EXPERT = 16
# prefill round: (block_n, block_k, num_warps, num_stages) for each GEMM in turn; GEMM1's N tile
# holds gate and up side by side, so its 128 is as wide as GEMM2's 256
_PREFILL_CHOICES = {
    "gemm1": tuple((n, k, w, s) for n in (64, 128) for k in (64, 128) for w in (4, 8)
                   for s in (3, 4, 5)),
    "gemm2": tuple((n, k, w, s) for n in (128, 256) for k in (64, 128) for w in (4, 8)
                   for s in (3, 4, 5)),
}  # fmt: skip
# Hopper's shared memory per block (227 KiB) less room for the epilogue's layout conversions
PREFILL_SMEM_BYTES = 216 * 1024
# per-pair round: (block_n, block_k, num_warps) for each GEMM in turn. GEMM2's programs take a
# token each (gemv.py), so at one token only narrow column tiles give every SM a program
_PER_PAIR_STEPS = ((4, 128), (8, 128), (16, 128), (32, 128), (64, 128), (4, 256), (8, 256),
                   (32, 256), (64, 64), (8, 512), (4, 1024), (8, 1024))  # fmt: skip
_PER_PAIR_CHOICES = tuple((n, k, w) for n, k in _PER_PAIR_STEPS for w in (2, 4, 8))
_PER_PAIR_ROWS_PER_EXPERT = 1
_FINALISTS = 4  # the fastest candidates of a bucket, timed again on each of _CONFIRM_ROUTINGS
_CONFIRM_ROUTINGS = 3


@dataclass(frozen=True)
class TuneRequest:
    cfg: MoEConfig
    tokens: tuple[int, ...]
    out: Path
    retune: bool = False  # search buckets the file already has again


def buckets_to_search(request: TuneRequest, buckets: dict) -> list[tuple[int, LayerTiles | None]]:
    """(M, the bucket's current tiles or None) for each bucket of the request to search: those
    the file lacks, or with `retune` every one."""
    from ..kernels.experts._triton.tiles import LayerTiles

    found = []
    for m in request.tokens:
        entry = buckets.get(str(m))
        if entry is None or request.retune:
            found.append((m, None if entry is None else LayerTiles.from_json(entry)))
    return found


def parse_shape(text: str) -> MoEConfig:
    """A reference shape by name (bench/shapes.py) or `E,H,I,top_k` (silu, bf16)."""
    from .shapes import SHAPES

    if text in SHAPES:
        return SHAPES[text]
    try:
        e, h, i, k = (int(v) for v in text.split(","))
    except ValueError as err:
        names = ", ".join(SHAPES)
        raise argparse.ArgumentTypeError(
            f"--shape must be one of {names} or E,H,I,top_k (four integers), got {text!r}"
        ) from err
    return MoEConfig(e, h, i, RoutingConfig(top_k=k))


def candidates(cfg: MoEConfig, num_tokens: int) -> list:
    """The heuristic's tiles, and each GEMM choice at its block_m and the next ones."""
    from ..kernels.experts._triton.grouped_gemm import GemmTile
    from ..kernels.experts._triton.tiles import heuristic_tiles, nested_block_k, stages_for

    base = heuristic_tiles(cfg, num_tokens, per_pair=False)
    block_ms = sorted({base.block_m, min(128, base.block_m * 2)})
    elem = 1 if cfg.quant.spec.act_quant else cfg.dtype.itemsize
    found = [base]
    for block_m in block_ms:
        for block_n, block_k, warps in _GEMM_CHOICES:
            if nested_block_k(cfg, block_k) != block_k:
                continue
            one = GemmTile(block_n, block_k, warps, stages_for(block_m, block_n, block_k, 2, elem))
            two = GemmTile(block_n, block_k, warps, stages_for(block_m, block_n, block_k, 1, elem))
            tile = replace(base, block_m=block_m, gemm1=one, gemm2=two)
            if tile not in found:
                found.append(tile)
    return found


def gemm2_choices(cfg: MoEConfig, best: LayerTiles) -> list[LayerTiles]:
    """Round two: the best tiles with each GEMM2 choice."""
    from ..kernels.experts._triton.grouped_gemm import GemmTile
    from ..kernels.experts._triton.tiles import nested_block_k, stages_for

    elem = 1 if cfg.quant.spec.act_quant else cfg.dtype.itemsize
    found = []
    for block_n, block_k, warps in _GEMM2_CHOICES:
        if nested_block_k(cfg, block_k) != block_k:
            continue
        stages = stages_for(best.block_m, block_n, block_k, 1, elem)
        gemm2 = GemmTile(block_n, block_k, warps, stages, best.gemm2.group_m)
        found.append(replace(best, gemm2=gemm2))
    return found


def order_choices(best: LayerTiles) -> list[LayerTiles]:
    """Round three: the best tiles in each program order."""
    return [
        replace(best, gemm1=replace(best.gemm1, group_m=g), gemm2=replace(best.gemm2, group_m=g))
        for g in _GROUP_M_CHOICES
    ]


def decode_choices(cfg: MoEConfig, best: LayerTiles, gemm: str) -> list[LayerTiles]:
    """Decode round: the best tiles with `gemm` ("gemm1" or "gemm2") over _DECODE_CHOICES, its
    block_k kept, those whose stages fit the shared-memory budget."""
    from ..kernels.experts._triton.tiles import SMEM_BUDGET_BYTES

    elem = 1 if cfg.quant.spec.act_quant else cfg.dtype.itemsize
    tile = getattr(best, gemm)
    b_tiles = 2 if gemm == "gemm1" else 1  # GEMM1 loads gate and up tiles
    found = []
    for block_n, warps, stages in _DECODE_CHOICES:
        per_stage = (best.block_m + b_tiles * block_n) * tile.block_k * elem
        if per_stage * stages <= SMEM_BUDGET_BYTES:
            changed = replace(tile, block_n=block_n, num_warps=warps, num_stages=stages)
            found.append(replace(best, **{gemm: changed}))
    return found


def prefill_choices(cfg: MoEConfig, best: LayerTiles, gemm: str) -> list[LayerTiles]:
    """Prefill round: the best tiles, at their block_m and at twice it (up to 128), with `gemm`
    over _PREFILL_CHOICES whose K step nests with the scale groups and whose pipeline fits
    PREFILL_SMEM_BYTES. The first round sized both GEMMs' pipelines for the heuristic's budget:
    a larger block_m can win only with the deeper pipelines tried here."""
    from ..kernels.experts._triton.tiles import nested_block_k

    elem = 1 if cfg.quant.spec.act_quant else cfg.dtype.itemsize
    b_tiles = 2 if gemm == "gemm1" else 1
    found = []
    for block_m in sorted({best.block_m, min(128, 2 * best.block_m)}):
        for block_n, block_k, warps, stages in _PREFILL_CHOICES[gemm]:
            per_stage = (block_m + b_tiles * block_n) * block_k * elem
            if nested_block_k(cfg, block_k) != block_k or per_stage * stages > PREFILL_SMEM_BYTES:
                continue
            tile = replace(getattr(best, gemm), block_n=block_n, block_k=block_k,
                           num_warps=warps, num_stages=stages)  # fmt: skip
            found.append(replace(best, block_m=block_m, **{gemm: tile}))
    return found


def per_pair_choices(cfg: MoEConfig, best: LayerTiles, gemm: str) -> list[LayerTiles]:
    """Per-pair round: `best` (per-pair tiles) with `gemm` over _PER_PAIR_CHOICES whose K step
    nests with the scale groups (fp8-block: a K step of several groups scales each column by
    its own, gemv.py)."""
    from ..kernels.experts._triton.tiles import nested_block_k

    found = []
    for block_n, block_k, warps in _PER_PAIR_CHOICES:
        if nested_block_k(cfg, block_k) == block_k:
            tile = replace(getattr(best, gemm), block_n=block_n, block_k=block_k, num_warps=warps)
            found.append(replace(best, **{gemm: tile}))
    return found


def fastest(timed: dict[LayerTiles, float], per_pair: bool) -> LayerTiles | None:
    """The fastest tiles timed so far among the per-pair ones, or among the grouped ones."""
    among = {tiles: us for tiles, us in timed.items() if tiles.per_pair == per_pair}
    return min(among, key=among.get, default=None)


def confirmed(
    finalists: list[LayerTiles], routings: list, measure: Callable[[LayerTiles, object], float]
) -> tuple[LayerTiles, float]:
    """The finalist with the lowest mean over `routings` of `measure(tiles, routing)`, each
    routing timing every finalist in turn (so drift of the clocks falls on all alike)."""
    total = dict.fromkeys(finalists, 0.0)
    for routing in routings:
        for tiles in finalists:
            total[tiles] += measure(tiles, routing)
    best = min(finalists, key=total.get)
    return best, total[best] / len(routings)


def _write_atomically(path: Path, body: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, path)


def tune(request: TuneRequest, device: torch.device) -> dict:
    """Search every bucket not yet in request.out; returns the file's content."""
    from tqdm import tqdm

    from ..kernels.experts._triton.tiles import TileKey, device_name, per_pair_tiles
    from ..kernels.experts.triton import TritonExperts
    from ..kernels.graph_capture import replay_of
    from ..kernels.prepare_finalize.no_ep import NoEP
    from ..kernels.routing import route
    from ..kernels.stages import DispatchSpec
    from ..kernels.timing import Timer, TimingPlan
    from ..kernels.workspace import Workspace
    from .environment import current_commit
    from .random_layer import random_layer

    cfg = request.cfg
    measured = {  # each bucket searched says where (kernels/tuned: PROVENANCE)
        "commit": current_commit(),
        "date": f"{datetime.now(UTC):%Y-%m-%d}",
        "command": shlex.join(["moe-serve", *sys.argv[1:]]),
    }
    key = TileKey.of(cfg, device_name(device))
    body = {"key": asdict(key), "buckets": {}}
    if request.out.exists():
        body = json.loads(request.out.read_text())
    todo = buckets_to_search(request, body["buckets"])
    weights = random_layer(cfg, device).experts
    timer = Timer(device, TimingPlan(warmup=2, min_iters=5, max_iters=30, budget_s=0.05))
    ws = Workspace(device)
    spec = DispatchSpec(cfg.quant.spec.act_quant, cfg.num_experts)
    body["search"] = (
        f"per bucket, three rounds around the best so far: the heuristic and "
        f"{len(_GEMM_CHOICES)} (block_n, block_k, warps) x 2 block_m (the heuristic's and twice "
        f"it) for both GEMMs; GEMM2 alone over {len(_GEMM2_CHOICES)}; program order (group_m "
        f"{', '.join(map(str, _GROUP_M_CHOICES))}); decode buckets (<= "
        f"{_DECODE_ROWS_PER_EXPERT} rows per expert) then each GEMM over {len(_DECODE_CHOICES)} "
        f"(block_n, warps, stages), prefill buckets each GEMM over "
        f"{len(_PREFILL_CHOICES['gemm1'])} (block_n, block_k, warps, stages) x 2 block_m within "
        f"{PREFILL_SMEM_BYTES // 1024} KiB of shared memory; buckets of <= "
        f"{_PER_PAIR_ROWS_PER_EXPERT} row per expert: "
        f"per-pair GEMVs, each GEMM over {len(_PER_PAIR_CHOICES)} (block_n, block_k, warps); "
        "median of CUDA-event timings of CUDA-graph replays, L2 flushed; uniform random "
        "routing; the fastest "
        f"{_FINALISTS} (and the bucket's tiles before a --retune) then timed on "
        f"{_CONFIRM_ROUTINGS} fresh routings each, the lowest mean kept ('us')"
    )
    with tqdm(desc=f"tune {key.filename()}", unit="cfg") as bar:

        def time_one(tile: LayerTiles, x: Dispatched) -> float | None:
            """Median us of the experts with these tiles on x, replayed from a CUDA graph as a
            served layer runs them (eager launches would add the host's launch time to small
            buckets); None where they fail to build."""
            experts = TritonExperts(cfg, weights, fixed_tiles=tile)
            bar.update()
            try:
                run = partial(experts.apply, x, ws)
                return timer.measure(replay_of(run) if device.type == "cuda" else run).median_us
            except Exception as err:  # a candidate the compiler rejects is skipped
                log.warning("M=%d: %s failed: %s", x.num_tokens, tile, str(err).splitlines()[-1])
                return None

        def time_each(tiles: list[LayerTiles], x: Dispatched, timed: dict) -> None:
            """Time each tile not yet in `timed` (tile -> median us) on the dispatched x."""
            for tile in tiles:
                if tile not in timed and (us := time_one(tile, x)) is not None:
                    timed[tile] = us

        def dispatched(m: int) -> Dispatched:
            """m random tokens on a fresh uniform routing (i.i.d. normal router logits)."""
            hidden = torch.randn(m, cfg.hidden_size, device=device).to(cfg.dtype)
            routing = route(torch.randn(m, cfg.num_experts, device=device), cfg.routing)
            return NoEP().prepare(hidden, routing, spec, ws)

        for m, current in todo:
            x = dispatched(m)
            timed: dict[LayerTiles, float] = {}
            time_each(candidates(cfg, m) + ([current] if current else []), x, timed)
            if fastest(timed, per_pair=False) is None:
                log.error("M=%d: no candidate ran; the bucket is left to the heuristic", m)
                continue
            time_each(gemm2_choices(cfg, fastest(timed, per_pair=False)), x, timed)
            time_each(order_choices(fastest(timed, per_pair=False)), x, timed)
            rounds = (
                decode_choices
                if m * cfg.top_k <= _DECODE_ROWS_PER_EXPERT * cfg.num_experts
                else prefill_choices
            )
            for gemm in ("gemm1", "gemm2"):
                time_each(rounds(cfg, fastest(timed, False), gemm), x, timed)
            if m * cfg.top_k <= _PER_PAIR_ROWS_PER_EXPERT * cfg.num_experts:
                for gemm in ("gemm1", "gemm2"):  # from --retune's per-pair tiles or the heuristic's
                    best_pair = fastest(timed, per_pair=True) or per_pair_tiles(cfg)
                    time_each(per_pair_choices(cfg, best_pair, gemm), x, timed)
            finalists = sorted(timed, key=timed.get)[:_FINALISTS]
            if current in timed and current not in finalists:
                finalists.append(current)
            routings = [dispatched(m) for _ in range(_CONFIRM_ROUTINGS)]
            best, us = confirmed(finalists, routings, lambda t, r: time_one(t, r) or float("inf"))
            body["buckets"][str(m)] = best.to_json() | {"us": round(us, 2)} | measured
            _write_atomically(request.out, body)
            log.info("M=%d: %s (%.1f us, mean of %d routings)", m, best, us, len(routings))
    return body


def run_tune(
    shape: MoEConfig,
    scheme: QuantScheme | None,
    tokens: tuple[int, ...],
    out: Path | None,
    retune: bool,
) -> Path:
    """Tune `shape` (in `scheme` where given) on this GPU; returns the tuned file written."""
    from ..kernels.experts._triton.tiles import TileKey, device_name
    from ..kernels.tuned import TUNED_DIR

    if not torch.cuda.is_available():
        raise ValueError("tuning times kernels on a CUDA GPU; none is visible here")
    device = torch.device("cuda")
    cfg = replace(shape, quant=QuantConfig(scheme)) if scheme else shape
    out = out or TUNED_DIR / TileKey.of(cfg, device_name(device)).filename()
    tune(TuneRequest(cfg, tokens, out, retune), device)
    return out
