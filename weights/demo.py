"""The embedded demo layers: small, seeded, generated on demand (never committed as binary).

"demo" is a bf16 SiLU layer with a router gate; "demo-fp8" holds the same values in fp8-block.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ..kernels.config import MoEConfig, RoutingConfig
from ..kernels.layer import LayerWeights, RouterWeights
from ..kernels.quant_scheme import QuantConfig, QuantScheme
from ..kernels.quantize import quantize_expert_weights
from ..kernels.random_weights import random_float_weights
from .errors import LayerFileError
from .load import verify_layer
from .manifest import Manifest, Source
from .write import write_layer

log = logging.getLogger(__name__)

DEMO_SEED = 0
# bump when the generator changes, so that cached copies count as stale
DEMO_SOURCE = Source(family="demo", model=f"moe-serve-demo-v1-seed{DEMO_SEED}", layer=0)
DEMO_CONFIG = MoEConfig(
    num_experts=8,
    hidden_size=256,
    intermediate_size=512,
    routing=RoutingConfig(top_k=2),
    dtype=torch.bfloat16,
)


DEMO_SCHEMES = {"demo": QuantScheme.NONE, "demo-fp8": QuantScheme.FP8_BLOCK}


def demo_configs() -> dict[str, MoEConfig]:
    """The demo layers' configs by name, without making their weights."""
    return {
        name: dataclasses.replace(DEMO_CONFIG, quant=QuantConfig(scheme))
        for name, scheme in DEMO_SCHEMES.items()
    }


def demo_layers() -> list[tuple[Manifest, LayerWeights]]:
    """The demo layers in memory (CPU), deterministic: [("demo", bf16), ("demo-fp8", fp8-block)]."""
    generator = torch.Generator().manual_seed(DEMO_SEED)
    cfg = DEMO_CONFIG
    floats = random_float_weights(cfg, generator)
    # round to bf16 first so that the fp8 copy quantises exactly the values "demo" serves
    floats = {n: t.to(cfg.dtype).float() for n, t in floats.items()}
    gate = torch.randn(cfg.num_experts, cfg.hidden_size, generator=generator) / cfg.hidden_size**0.5
    router = RouterWeights(weight=gate.to(cfg.dtype))
    layers = []
    for name, layer_cfg in demo_configs().items():
        weights = LayerWeights(quantize_expert_weights(layer_cfg, floats), router)
        manifest = Manifest.from_config(layer_cfg, weights, name=name, source=DEMO_SOURCE)
        layers.append((manifest, weights))
    return layers


def _is_current(path: Path, expected: Manifest) -> bool:
    """Whether `path` already holds `expected`, intact: same manifest, with checksums that the
    data matches (a copy whose manifest has no checksums is rewritten to gain them)."""
    try:
        found = verify_layer(path)
    except (LayerFileError, OSError, ValueError):
        return False
    hashes = {"tensors_sha256": found.tensors_sha256, "tensors_xxh3": found.tensors_xxh3}
    return bool(found.tensors_xxh3) and found == expected.model_copy(update=hashes)


def ensure_demo_layers(cache_dir: Path) -> list[Path]:
    """Write the demo layers under `cache_dir` unless current copies are there; their dirs."""
    paths = []
    for manifest, weights in demo_layers():
        path = Path(cache_dir) / manifest.name
        if _is_current(path, manifest):
            log.info("demo layer %r is current at %s", manifest.name, path)
        else:
            write_layer(path, weights, manifest)
        paths.append(path)
    return paths
