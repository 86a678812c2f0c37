"""Time `load_layer` onto a GPU for a random DeepSeek-V3-sized fp8-block layer (~11 GB):
`moe-serve bench service --mode weights`.

Writes the layer in a temporary directory (generated on the GPU, so it takes seconds), then
loads it: once with its pages dropped from the OS cache (posix_fadvise DONTNEED: read from
disk), then `repeats` times warm (page cache), beside `safetensors.torch.load_file(device=...)`
as the stock baseline; every load is checked bit for bit against what was written.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..kernels.config import MoEConfig
from ..kernels.layer import LayerWeights, RouterWeights, SharedExpert
from ..kernels.quant_scheme import FP8
from ..kernels.tensors import ExpertWeights
from ..weights.load import load_layer
from ..weights.manifest import TENSORS_FILE, Manifest, Source
from ..weights.write import write_layer
from .schema import Environment, write_result
from .shapes import SHAPES

log = logging.getLogger(__name__)

# DeepSeek-V3 (and Kimi-K2 / R1) MoE layer: 256 experts, 8 per token, 1 shared expert
DSV3 = SHAPES["deepseek-v3"]


def random_fp8_layer(cfg: MoEConfig, device: torch.device) -> LayerWeights:
    """Random fp8-block experts (+ router, correction bias, shared expert) on the CPU, made on
    `device` a few experts at a time."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    gen = torch.Generator(device).manual_seed(0)

    def fp8(*shape: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=FP8)
        for start in range(0, shape[0], 16):
            part = torch.randn(min(16, shape[0] - start), *shape[1:], device=device, generator=gen)
            out[start : start + part.shape[0]] = (part * 64).to(FP8).cpu()
        return out

    def scale(*shape: int) -> torch.Tensor:
        return (torch.rand(shape, device=device, generator=gen) + 0.5).mul(1e-4).cpu()

    def bf16(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, device=device, generator=gen) * 0.02).to(cfg.dtype).cpu()

    experts = ExpertWeights(
        fp8(e, 2 * i, h),
        fp8(e, h, i),
        scale(e, 2 * i // 128, h // 128),
        scale(e, h // 128, i // 128),
    )
    router = RouterWeights(weight=bf16(e, h), correction_bias=scale(e))
    return LayerWeights(experts, router, SharedExpert(bf16(2 * i, h), bf16(h, i)))


@dataclass(frozen=True)
class Timing:
    what: str
    seconds: list[float]
    nbytes: int

    def row(self) -> dict:
        median = statistics.median(self.seconds)
        return {"load": self.what, "runs": len(self.seconds), "median_s": median,
                "gb_per_s": self.nbytes / 1e9 / median}  # fmt: skip


def _same(loaded: torch.Tensor, written: torch.Tensor) -> bool:
    """Bitwise equality of the experts 0, 137 and 255 (or the whole tensor when it is small)."""
    if loaded.shape != written.shape or loaded.dtype != written.dtype:
        return False
    if loaded.shape[0] == DSV3.num_experts and loaded.dim() == 3:
        loaded, written = loaded[[0, 137, 255]], written[[0, 137, 255]]
    return torch.equal(loaded.cpu().view(torch.uint8), written.view(torch.uint8))


def drop_page_cache(file: Path) -> None:
    """Ask the OS to forget `file`'s cached pages, so that the next read comes from disk."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(load: Callable[[], dict[str, torch.Tensor]], device: torch.device) -> tuple[float, dict]:
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    tensors = load()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start, tensors


def render(result: dict) -> str:
    env = Environment.model_validate(result["environment"])
    lines = [
        f"# Loading a DeepSeek-V3-sized layer: {env.device}, commit {env.commit}",
        "",
        f"file {result['bytes'] / 1e9:.2f} GB (E=256, H=7168, I=2048, fp8-block)",
        "",
        "| load | runs | median s | GB/s |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['load']} | {r['runs']} | {r['median_s']:.2f} | {r['gb_per_s']:.2f} |"
        for r in result["rows"]
    ]
    return "\n".join(lines) + "\n"


def run(repeats: int, env: Environment, path: Path) -> dict:
    """Cold, then warm loads; writes `path` and its .md."""
    if not torch.cuda.is_available():
        raise ValueError("the weight-loading benchmark loads onto a CUDA GPU; none is visible")
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory(prefix="moe-serve-bench-layer-") as work:
        directory = Path(work)
        start = time.perf_counter()
        weights = random_fp8_layer(DSV3, device)
        source = Source(family="deepseek_v3", model="random", layer=3)
        manifest = Manifest.from_config(DSV3, weights, name="dsv3-random", source=source)
        write_layer(directory, weights, manifest)
        reference = weights.tensors()
        del weights
        log.info("generated and wrote the layer in %.1f s", time.perf_counter() - start)
        file = directory / TENSORS_FILE
        nbytes = file.stat().st_size

        def ours() -> dict[str, torch.Tensor]:
            return load_layer(directory, device).weights.tensors()

        def stock() -> dict[str, torch.Tensor]:
            return load_file(file, device=str(device))

        timings = []
        for what, load, cold in (
            ("load_layer, cold (page cache dropped)", ours, True),
            ("load_layer, warm page cache", ours, False),
            ("safetensors load_file, warm page cache", stock, False),
        ):
            seconds = []
            for _ in range(1 if cold else repeats):
                if cold:
                    drop_page_cache(file)
                took, tensors = timed(load, device)
                bad = [n for n, t in reference.items() if not _same(tensors[n], t)]
                if bad:
                    raise RuntimeError(f"{what}: tensors differ from what was written: {bad}")
                del tensors
                seconds.append(took)
            timings.append(Timing(what, seconds, nbytes))
    result = {"environment": env.model_dump(), "bytes": nbytes, "rows": [t.row() for t in timings]}
    write_result(path, result, render(result))
    return result
