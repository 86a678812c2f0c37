"""`moe-serve convert`: read layer N of a checkpoint, requantise if asked, write a layer dir."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from ...kernels.layer import LayerWeights
from ...kernels.quant_scheme import QuantConfig
from ...kernels.quantize import dequantize_weight, quantize_expert_weights
from ...kernels.tensors import ExpertWeights
from ..manifest import NAME_PATTERN, Manifest
from ..write import write_layer
from . import deepseek, gpt_oss, mixtral, qwen_moe
from .hf import Checkpoint, ConvertedLayer

log = logging.getLogger(__name__)

# config.json model_type -> the family module that reads it
FAMILIES: dict[str, Callable[[Checkpoint, int], ConvertedLayer]] = {
    "mixtral": mixtral.convert,
    "qwen2_moe": qwen_moe.convert,
    "qwen3_moe": qwen_moe.convert,
    "deepseek_v2": deepseek.convert,
    "deepseek_v3": deepseek.convert,
    "gpt_oss": gpt_oss.convert,
}


def read_layer(src: Path, layer: int) -> ConvertedLayer:
    """Layer `layer` of the checkpoint at `src`, in the checkpoint's own quantisation."""
    with Checkpoint(src) as ckpt:
        family = FAMILIES.get(ckpt.model_type)
        if family is None:
            raise ckpt.config_error(
                f"model_type {ckpt.model_type!r} is not supported; expected one of "
                f"{', '.join(FAMILIES)}"
            )
        return family(ckpt, layer)


def requantize(layer: ConvertedLayer, quant: QuantConfig) -> ConvertedLayer:
    """The layer's experts in `quant`'s layout, one expert at a time (bounded memory).

    Kept as is when already in that layout (no round trip); otherwise dequantised exactly and
    quantised with kernels.quantize, the one quantiser.
    """
    if quant == layer.config.quant:
        return layer
    old = layer.config.quant
    cfg = dataclasses.replace(layer.config, quant=quant)  # checks the sizes fit the scheme
    src = layer.weights.experts
    parts = []
    for e in range(src.num_experts):
        one = slice(e, e + 1)
        floats = {
            "w13": dequantize_weight(
                src.w13[one], _at(src.w13_scale, one), old, layer.config.w13_parts
            ),
            "w2": dequantize_weight(src.w2[one], _at(src.w2_scale, one), old),
        }
        floats |= {n: t[one] for n, t in src.tensors().items() if n.endswith("_bias")}
        parts.append(quantize_expert_weights(cfg, floats).tensors())
    experts = ExpertWeights(**{n: torch.cat([p[n] for p in parts]) for n in parts[0]})
    weights = LayerWeights(experts, layer.weights.router, layer.weights.shared)
    return ConvertedLayer(cfg, weights, layer.source)


def _at(scale: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if scale is None else scale[rows]


def default_name(src: Path, layer: int) -> str:
    """`<model dir>-layer<N>`, reduced to the characters a layer name may hold."""
    # runs of anything else, dashes included, become one dash
    name = re.sub(r"[^A-Za-z0-9._]+", "-", f"{Path(src).resolve().name}-layer{layer}")
    return name.lstrip("._-")[-64:] or f"layer{layer}"


def convert_checkpoint(
    src: Path, layer: int, out: Path, quant: QuantConfig | None = None, name: str | None = None
) -> Manifest:
    """Convert layer `layer` of the Hugging Face checkpoint `src` into the layer dir `out`.

    `quant` None keeps the checkpoint's quantisation. Nothing is written unless all succeeds.
    """
    name = name or default_name(src, layer)
    if not re.fullmatch(NAME_PATTERN, name):
        raise ValueError(
            f"layer name {name!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    converted = read_layer(src, layer)
    if quant is not None:
        converted = requantize(converted, quant)
    manifest = Manifest.from_config(
        converted.config, converted.weights, name=name, source=converted.source
    )
    manifest = write_layer(out, converted.weights, manifest)
    log.info("converted %s layer %d to %s (%s)", src, layer, out, manifest.config.quant.scheme)
    return manifest
