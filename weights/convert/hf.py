"""Reading a Hugging Face model directory lazily: config.json, one or many safetensors shards
(with `model.safetensors.index.json`), only the tensors asked for, each checked on arrival.

Every problem is a LayerFileError naming the file (config.json, the index, the shard) and the
tensor. The family modules (mixtral, qwen_moe, deepseek, gpt_oss) build on this.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ...kernels.arith import ceil_div
from ...kernels.config import DTYPES, Activation, MoEConfig
from ...kernels.layer import LayerWeights, SharedExpert
from ...kernels.quant_scheme import FP8, FP8_BLOCK, QuantConfig, QuantScheme
from ...kernels.quantize import dequantize_weight
from ...kernels.tensors import ExpertWeights
from ..errors import LayerFileError
from ..integrity import first_nonfinite
from ..manifest import Source

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class ConvertedLayer:
    """One MoE layer read from a checkpoint, in the checkpoint's own quantisation."""

    config: MoEConfig
    weights: LayerWeights
    source: Source


class Checkpoint:
    """A model directory opened for lazy reads; use as a context manager (closes the shards)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.config = self._read_config()
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        self._where = self._index()  # tensor name -> shard path

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    # ---- config.json ------------------------------------------------------------------------

    def _read_config(self) -> dict[str, Any]:
        file = self.root / CONFIG_FILE
        if not file.is_file():
            raise LayerFileError(file, None, "missing: not a Hugging Face model directory")
        try:
            config = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise LayerFileError(file, None, f"not valid JSON: {err}") from err
        if not isinstance(config, dict):
            raise LayerFileError(file, None, "must hold a JSON object")
        return config

    def config_error(self, message: str) -> LayerFileError:
        return LayerFileError(self.root / CONFIG_FILE, None, message)

    def config_int(self, key: str, default: int | None = None) -> int:
        """A positive integer from config.json (`default` when absent or null)."""
        value = self.config.get(key)
        if value is None:
            value = default
        if value is None:
            raise self.config_error(f"missing key {key!r}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.config_error(f"{key!r} must be a non-negative integer, got {value!r}")
        return value

    def dtype(self) -> torch.dtype:
        """The layer dtype: config.json's torch_dtype (bfloat16 when absent)."""
        name = self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16"
        if name not in DTYPES:
            raise self.config_error(f"torch_dtype {name!r} is not one of {sorted(DTYPES)}")
        return DTYPES[name]

    def activation(self) -> Activation:
        act = self.config.get("hidden_act", "silu")
        if act not in (Activation.SILU, Activation.GELU):
            raise self.config_error(f"hidden_act {act!r} is not supported; expected silu or gelu")
        return Activation(act)

    def check_layer(self, layer: int) -> None:
        count = self.config_int("num_hidden_layers")
        if not 0 <= layer < count:
            raise self.config_error(f"layer {layer} is out of range: num_hidden_layers is {count}")

    def source(self, layer: int) -> Source:
        return Source(family=self.model_type, model=self.root.resolve().name, layer=layer)

    # ---- tensors ----------------------------------------------------------------------------

    def _index(self) -> dict[str, Path]:
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
                raise LayerFileError(index, None, f"not a safetensors index: {err!r}") from err
            return {name: self.root / shard for name, shard in weight_map.items()}
        files = sorted(self.root.glob("*.safetensors"))
        if not files:
            raise LayerFileError(self.root, None, f"no *.safetensors files and no {INDEX_FILE}")
        where: dict[str, Path] = {}
        for file in files:
            where |= dict.fromkeys(self._open(file, None).keys(), file)
        return where

    def _open(self, file: Path, tensor: str | None) -> Any:
        if file not in self._handles:
            if not file.is_file():
                raise LayerFileError(file, tensor, f"shard missing (listed in {INDEX_FILE})")
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except SafetensorError as err:
                raise LayerFileError(file, tensor, f"unreadable safetensors file: {err}") from err
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file]

    def has(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        if name not in self._where:
            listing = INDEX_FILE if (self.root / INDEX_FILE).is_file() else "*.safetensors"
            raise LayerFileError(self.root / listing, name, "missing from the checkpoint")
        return self._where[name]

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        dtypes: tuple[torch.dtype, ...] | None = None,
        *,
        e8m0: bool = False,
    ) -> torch.Tensor:
        """Read one tensor, checking its shape (from config.json), dtype and that its values are
        finite (`e8m0`: a uint8 tensor of e8m0 scales, whose code 255 is NaN)."""
        file = self.file_of(name)
        handle = self._open(file, name)
        try:
            tensor = handle.get_tensor(name)
        except SafetensorError as err:
            raise LayerFileError(file, name, f"unreadable: {err}") from err
        if tuple(tensor.shape) != tuple(shape):
            raise LayerFileError(
                file,
                name,
                f"shape {list(tensor.shape)} contradicts config.json (expected {list(shape)})",
            )
        if dtypes is not None and tensor.dtype not in dtypes:
            expected = " or ".join(str(d) for d in dtypes)
            raise LayerFileError(file, name, f"dtype {tensor.dtype}, expected {expected}")
        bad = first_nonfinite(tensor, e8m0=e8m0)
        if bad is not None:
            raise LayerFileError(file, name, f"holds NaN or Inf (first at index {bad})")
        return tensor

    def get_float(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.get(name, shape, tuple(DTYPES.values()))

    def quantization(self) -> dict[str, Any] | None:
        """config.json's quantization_config, None for an unquantised checkpoint."""
        quant = self.config.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise self.config_error(f"quantization_config must be an object, got {quant!r}")
        return quant

    def fp8_block(self) -> bool:
        """Whether quantization_config declares DeepSeek-style fp8: 128 x 128 weight blocks with
        `.weight_scale_inv` dequantisation multipliers. Any other quantisation is refused."""
        quant = self.quantization()
        if quant is None:
            return False
        method = quant.get("quant_method")
        if method != "fp8":
            raise self.config_error(f"quantization_config.quant_method {method!r} is not supported")
        if quant.get("fmt", "e4m3") != "e4m3" or quant.get("weight_block_size") != [128, 128]:
            raise self.config_error(
                "fp8 checkpoints must use fmt e4m3 and weight_block_size [128, 128], got "
                f"{quant.get('fmt')!r} and {quant.get('weight_block_size')!r}"
            )
        return True

    def get_fp8_block(self, name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """An fp8 weight [N, K] and its `_scale_inv` [ceil(N/128), ceil(K/128)] float32."""
        weight = self.get(name, shape, (FP8,))
        scale_name = f"{name}_scale_inv"
        if not self.has(scale_name):
            raise LayerFileError(self.file_of(name), scale_name, "fp8 weight without its scale")
        blocks = tuple(ceil_div(n, FP8_BLOCK) for n in shape)
        scale = self.get(scale_name, blocks, (torch.float32,))
        return weight, scale

    def get_linear(self, name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A linear weight [N, K] in `dtype`, dequantised exactly when stored as fp8 blocks."""
        if not self.fp8_block():
            return self.get_float(name, shape).to(dtype)
        weight, scale = self.get_fp8_block(name, shape)
        block = QuantConfig(QuantScheme.FP8_BLOCK)
        return dequantize_weight(weight[None], scale[None], block)[0].to(dtype)


# Qwen-MoE and DeepSeek name their expert MLPs alike: mlp.experts.{e}.{gate,up,down}_proj
HF_EXPERT_TEMPLATE = ".experts.{e}.{proj}.weight"
HF_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stack_gated_experts(
    ckpt: Checkpoint,
    template: str,
    projections: tuple[str, str, str],
    sizes: tuple[int, int, int],
    dtype: torch.dtype,
) -> ExpertWeights:
    """Per-expert gate/up/down weights -> stacked ExpertWeights, unquantised or fp8-block.

    `template` has `{e}` and `{proj}` fields; `projections` are the (gate, up, down) names;
    `sizes` is (E, H, I). Gate [I, H] and up [I, H] stack into w13 [E, 2I, H] (gate rows first);
    down [H, I] into w2 [E, H, I]. fp8 blocks and their scales are kept bit for bit, partial
    last blocks (H or I not a multiple of 128) included.
    """
    e_count, h, i = sizes
    gate, up, down = projections
    if not ckpt.fp8_block():
        w13, w2 = [], []
        for e in range(e_count):
            g = ckpt.get_float(template.format(e=e, proj=gate), (i, h))
            u = ckpt.get_float(template.format(e=e, proj=up), (i, h))
            w13.append(torch.cat([g, u]).to(dtype))
            w2.append(ckpt.get_float(template.format(e=e, proj=down), (h, i)).to(dtype))
        return ExpertWeights(torch.stack(w13), torch.stack(w2))
    # gate's and up's scales stack as they are: w13 is blocked per half (quant_scheme.py), so an
    # I that 128 does not divide keeps each half's partial last block
    parts: dict[str, list[torch.Tensor]] = {"w13": [], "w13_scale": [], "w2": [], "w2_scale": []}
    for e in range(e_count):
        g, g_scale = ckpt.get_fp8_block(template.format(e=e, proj=gate), (i, h))
        u, u_scale = ckpt.get_fp8_block(template.format(e=e, proj=up), (i, h))
        d, d_scale = ckpt.get_fp8_block(template.format(e=e, proj=down), (h, i))
        for key, value in (
            ("w13", torch.cat([g, u])),
            ("w13_scale", torch.cat([g_scale, u_scale])),
            ("w2", d),
            ("w2_scale", d_scale),
        ):
            parts[key].append(value)
    return ExpertWeights(**{key: torch.stack(values) for key, values in parts.items()})


def read_shared_expert(
    ckpt: Checkpoint,
    template: str,
    sizes: tuple[int, int],
    dtype: torch.dtype,
    gate_name: str | None = None,
) -> SharedExpert:
    """`template` with a `{proj}` field for gate_proj/up_proj/down_proj; sizes (H, I_s).

    Stored in the layer dtype (fp8 shared experts are dequantised), with the optional
    sigmoid gate [1, H] (Qwen2-MoE)."""
    h, i = sizes
    g = ckpt.get_linear(template.format(proj="gate_proj"), (i, h), dtype)
    u = ckpt.get_linear(template.format(proj="up_proj"), (i, h), dtype)
    d = ckpt.get_linear(template.format(proj="down_proj"), (h, i), dtype)
    gate = None if gate_name is None else ckpt.get_float(gate_name, (1, h)).to(dtype)
    return SharedExpert(torch.cat([g, u]), d, gate)


def moe_config(ckpt: Checkpoint, sizes: tuple[int, int, int], **fields: Any) -> MoEConfig:
    """MoEConfig from (E, H, I) and the family's other fields, in the checkpoint's quantisation
    (fp8-block or none) unless `fields` says otherwise. A contradiction in config.json
    (top_k > E, ...) is reported against config.json."""
    e_count, h, i = sizes
    if "quant" not in fields:
        scheme = QuantScheme.FP8_BLOCK if ckpt.fp8_block() else QuantScheme.NONE
        fields["quant"] = QuantConfig(scheme)
    fields = {"dtype": ckpt.dtype()} | fields
    try:
        return MoEConfig(num_experts=e_count, hidden_size=h, intermediate_size=i, **fields)
    except ValueError as err:
        raise ckpt.config_error(str(err)) from err
