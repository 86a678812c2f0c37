"""`manifest.json`: what a layer directory holds, read and written through one typed schema."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_serializer,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails

from ..kernels.config import DTYPES, MoEConfig
from ..kernels.layer import LayerWeights

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "experts.safetensors"

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # layer names appear in URLs
_DTYPE_NAME = TypeAdapter(Literal[tuple(DTYPES)])


class Source(BaseModel):
    """Where the layer came from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str  # mixtral | qwen2_moe | qwen3_moe | deepseek_v2 | deepseek_v3 | gpt_oss | demo
    model: str  # the checkpoint directory's name (or the demo generator)
    layer: int = Field(ge=0)


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(MoEConfig))


def _relocated(err: ValidationError, where: Callable[[tuple], tuple]) -> ValidationError:
    """`err` with each error's location passed through `where`."""
    details = [
        InitErrorDetails(
            type=e["type"], loc=where(e["loc"]), input=e["input"], ctx=e.get("ctx", {})
        )
        for e in err.errors()
    ]
    return ValidationError.from_exception_data(err.title, details)


class Manifest(BaseModel):
    """One MoE layer directory: the layer's MoEConfig, which optional parts exist, the tensors'
    hash. The tensors' shapes and dtypes follow from these (`weights.layout.expected_tensors`).

    On disk (format 1) the config's fields sit at the top level beside the others, the dtype by
    name, and errors name them so: `quant.scheme`, not `config.quant.scheme`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    format_version: Literal[1] = FORMAT_VERSION
    name: str = Field(pattern=NAME_PATTERN)
    source: Source
    config: MoEConfig  # sizes, routing (top_k too), activation, quant, dtype, biases
    router: bool = False  # gate [E, H]: clients may omit router logits
    router_bias: bool = False  # gate_bias [E] (gpt-oss)
    correction_bias: bool = False  # e_score_correction_bias [E] (DeepSeek-V3)
    shared_experts: bool = False
    shared_intermediate_size: int = Field(default=0, ge=0)
    shared_gate: bool = False  # Qwen2-MoE sigmoid gate [1, H] on the shared expert
    tensors_sha256: str = ""  # sha256 of experts.safetensors' header (names, dtypes, offsets)
    # weights.integrity: tensor name -> xxh3-64 of its bytes, one per expert for the tensors with
    # an expert axis. Empty where a manifest has no checksums (its directory loads with a warning).
    tensors_xxh3: dict[str, list[str]] = Field(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _from_flat(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Manifest:
        """Gather the config's top-level fields (as manifest.json holds them) into `config`."""
        if isinstance(data, dict) and "config" not in data:
            config = {k: data[k] for k in _CONFIG_FIELDS if k in data}
            if "dtype" in config:
                try:
                    config["dtype"] = DTYPES[_DTYPE_NAME.validate_python(config["dtype"])]
                except ValidationError as err:
                    raise _relocated(err, lambda loc: ("dtype", *loc)) from None
            data = {k: v for k, v in data.items() if k not in config} | {"config": config}
        try:
            return handler(data)
        except ValidationError as err:  # name the config's fields as the file does
            raise _relocated(err, lambda loc: loc[1:] if loc[:1] == ("config",) else loc) from None

    @field_serializer("config")
    def _config_fields(self, cfg: MoEConfig) -> dict[str, Any]:
        return cfg.as_json()

    @model_serializer(mode="wrap")
    def _to_flat(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for key, value in handler(self).items():
            flat |= value if key == "config" else {key: value}
        return flat

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.shared_experts != (self.shared_intermediate_size > 0):
            raise ValueError("shared_intermediate_size must be > 0 exactly when shared_experts")
        if self.shared_gate and not self.shared_experts:
            raise ValueError("shared_gate needs shared_experts")
        if self.router_bias and not self.router:
            raise ValueError("router_bias needs router")
        return self

    @classmethod
    def from_config(
        cls, cfg: MoEConfig, weights: LayerWeights, *, name: str, source: Source
    ) -> Manifest:
        """The manifest of `weights` (laid out as `cfg` says); the hashes are filled in on write."""
        router, shared = weights.router, weights.shared
        return cls(
            name=name,
            source=source,
            config=cfg,
            router=router.weight is not None,
            router_bias=router.bias is not None,
            correction_bias=router.correction_bias is not None,
            shared_experts=shared is not None,
            shared_intermediate_size=0 if shared is None else shared.w2.shape[1],
            shared_gate=shared is not None and shared.gate is not None,
        )
