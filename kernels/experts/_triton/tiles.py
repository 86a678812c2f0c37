"""Tile sizes for one layer and batch: a tuned JSON file when one matches, else a heuristic.

Files live in kernels/tuned/ (written by `moe-serve bench tune`), one per layer shape, scheme, dtype
and GPU; inside, one entry per token-count bucket M. Both GEMMs share block_m, because they
share the expert-aligned row order; each has its own block_n / block_k / warps / stages. A
`per_pair` entry runs GEMVs instead (gemv.py), for decode batches where each expert sees about
one row: GEMM1 one per (token, expert) pair, GEMM2 one per token, summing its pairs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from functools import cache

import torch
import triton

from ...config import MoEConfig
from ...quant_scheme import QuantScheme
from ...tuned import TUNED_DIR
from .grouped_gemm import GemmTile

log = logging.getLogger(__name__)

INVARIANT_TOKENS = 64  # batch-invariant experts run the tiles of this token count at every M
_BUCKET_REACH = 2.0  # a tuned bucket answers for token counts within this factor of it
SMEM_BUDGET_BYTES = 160 * 1024  # of Hopper's 227 KiB per block, leaving room for the epilogue
# the heuristic runs per-pair GEMVs up to this many pairs per expert: an expert's weights are
# then read about once (each of its pairs reads them again, from L2 at best)
PER_PAIR_ROWS_PER_EXPERT = 0.25


@dataclass(frozen=True)
class LayerTiles:
    block_m: int  # unused per pair
    gemm1: GemmTile
    gemm2: GemmTile
    per_pair: bool = False  # one GEMV per (token, expert) pair, no align step (gemv.py)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, entry: dict) -> LayerTiles:
        gemm1, gemm2 = GemmTile(**entry["gemm1"]), GemmTile(**entry["gemm2"])
        return cls(entry["block_m"], gemm1, gemm2, entry.get("per_pair", False))


@dataclass(frozen=True)
class TileKey:
    """What a tuned file is specific to."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    scheme: str
    dtype: str
    device_name: str

    @classmethod
    def of(cls, cfg: MoEConfig, device_name: str) -> TileKey:
        dtype = str(cfg.dtype).removeprefix("torch.")
        return cls(
            cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.quant.scheme, dtype,
            device_name,
        )  # fmt: skip

    def filename(self) -> str:
        device = "".join(c if c.isalnum() else "_" for c in self.device_name)
        return (
            f"E{self.num_experts}_H{self.hidden_size}_I{self.intermediate_size}_{self.scheme}_"
            f"{self.dtype}_{device}.json"
        )


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@cache
def _tuned_table(filename: str) -> dict[int, LayerTiles]:
    path = TUNED_DIR / filename
    if not path.exists():
        return {}
    buckets = json.loads(path.read_text())["buckets"]
    log.info("using tuned Triton tiles from %s", path.name)
    return {int(m): LayerTiles.from_json(entry) for m, entry in buckets.items()}


def stages_for(block_m: int, block_n: int, block_k: int, b_tiles: int, elem_bytes: int) -> int:
    """As many pipeline stages (2 to 4) as fit the shared-memory budget."""
    per_stage = (block_m * block_k + b_tiles * block_k * block_n) * elem_bytes
    return max(2, min(4, SMEM_BUDGET_BYTES // per_stage))


def nested_block_k(cfg: MoEConfig, block_k: int) -> int:
    """The largest block_k <= the given one whose tiles nest with the scale groups (a tile within
    one group, or whole groups per tile); 0 if none of at least 16 does."""
    group = cfg.quant.spec.k_group
    while group and block_k >= 16 and group % block_k and block_k % group:
        block_k //= 2
    return block_k if block_k >= 16 else 0


def heuristic_tiles(cfg: MoEConfig, num_tokens: int, per_pair: bool = True) -> LayerTiles:
    """Per-pair GEMVs (when `per_pair` allows) where experts see a fraction of a row each, small
    row tiles when each expert sees few rows (decode), large ones for prefill."""
    rows_per_expert = num_tokens * cfg.top_k / cfg.num_experts
    if per_pair and rows_per_expert <= PER_PAIR_ROWS_PER_EXPERT:
        return per_pair_tiles(cfg)
    if rows_per_expert <= 16:
        block_m, block_n, block_k, warps = 16, 64, 128, 4
    elif rows_per_expert <= 64:
        block_m, block_n, block_k, warps = 32, 64, 128, 4
    elif rows_per_expert <= 256:
        block_m, block_n, block_k, warps = 64, 128, 64, 4
    else:
        block_m, block_n, block_k, warps = 128, 128, 64, 8
    block_k = nested_block_k(cfg, block_k)
    elem = 1 if cfg.quant.spec.act_quant else cfg.dtype.itemsize
    # GEMM1 keeps gate and up accumulators: halve its N tile at BLOCK_M 128 to stay in registers
    n1 = block_n // 2 if block_m == 128 else block_n
    # prefill: row blocks swizzled in groups of 8, faster than row blocks first on DeepSeek-V3,
    # Qwen3 and Mixtral at prefill sizes and equal in decode (`moe-serve bench tune`'s program
    # order)
    group_m = 8 if rows_per_expert > 64 else 0
    gemm1 = GemmTile(n1, block_k, warps, stages_for(block_m, n1, block_k, 2, elem), group_m)
    gemm2 = GemmTile(block_n, block_k, warps, stages_for(block_m, block_n, block_k, 1, elem),
                     group_m)  # fmt: skip
    return LayerTiles(block_m, gemm1, gemm2)


def per_pair_tiles(cfg: MoEConfig) -> LayerTiles:
    """The heuristic's per-pair GEMV tiles: 16 columns, K steps of 256 bytes of 16-bit weights
    (2 warps) or 256 columns of 8-bit and int4 ones (4 warps), the best of a per-pair tile
    sweep for DeepSeek-V3 and Qwen3 at 1-8 tokens (gemv.py); mxfp4 (gemv._mxfp4_sums) K steps
    of 1024 columns (at most K's next power of two), GEMM1 4 columns on 2 warps, GEMM2 8 on 4,
    the best for gpt-oss at 1-4 tokens. `moe-serve bench tune` searches the same tiles per
    bucket."""
    if cfg.quant.scheme == QuantScheme.MXFP4:
        gemm1 = GemmTile(4, min(1024, triton.next_power_of_2(cfg.hidden_size)), 2, 1)
        gemm2 = GemmTile(8, min(1024, triton.next_power_of_2(cfg.intermediate_size)), 4, 1)
        return LayerTiles(16, gemm1, gemm2, per_pair=True)
    sixteen_bit = cfg.quant.spec.values.storage is None and cfg.dtype.itemsize == 2
    block_k, warps = (128, 2) if sixteen_bit else (nested_block_k(cfg, 256), 4)
    tile = GemmTile(16, block_k, warps, 1)
    return LayerTiles(16, tile, tile, per_pair=True)


def tiles_for(
    cfg: MoEConfig, num_tokens: int, device: torch.device, per_pair: bool = True
) -> LayerTiles:
    """The tuned entry of the nearest M bucket (in ratio, at most 2x away) for this layer on this
    GPU, else the heuristic; `per_pair` False: never per-pair tiles (the batched format, batch
    invariance), the heuristic's grouped ones where the entry is per pair."""
    table = _tuned_table(TileKey.of(cfg, device_name(device)).filename())
    m = max(num_tokens, 1)
    nearest = min(table, key=lambda b: (max(b / m, m / b), b), default=None)
    if nearest is None or max(nearest / m, m / nearest) > _BUCKET_REACH:
        return heuristic_tiles(cfg, num_tokens, per_pair)
    if table[nearest].per_pair and not per_pair:
        return heuristic_tiles(cfg, num_tokens, per_pair=False)
    return table[nearest]
