"""Pydantic bodies of the /v1 API and the introspection routes (the probes' are in
service/http/probes.py, which the front ends import without torch)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .examples import DEMO_ROWS


def inline_json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with its `$defs` substituted in place, for an OpenAPI request body
    written by hand (a `#/$defs/...` reference does not resolve inside an OpenAPI document)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    return resolve(schema)


class ErrorBody(BaseModel):
    error: str = Field(examples=["hidden_states has 4 columns; this layer's hidden_size is 256"])


class ForwardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hidden_states: list[list[float]] = Field(
        description="[tokens, hidden_size] activations entering the MoE block",
        examples=[DEMO_ROWS],
    )
    router_logits: list[list[float]] | None = Field(
        None,
        description="[tokens, num_experts]; omitted: computed from the layer's stored router",
    )
    return_routing: bool = Field(False, description="also return topk_ids and topk_weights")


class ForwardResponse(BaseModel):
    output: list[list[float]] = Field(description="[tokens, hidden_size] MoE block output")
    layer: str
    tokens: int
    backend: str = Field(description="the experts backend that ran the forward")
    topk_ids: list[list[int]] | None = Field(None, description="[tokens, top_k] expert ids")
    topk_weights: list[list[float]] | None = Field(None, description="[tokens, top_k] weights")


class TokenRange(BaseModel):
    from_tokens: int = Field(description="this backend runs forwards of this many tokens or more")
    backend: str


BY_TOKENS = (
    "which experts backend runs a forward, by its token count: each entry up to the next one's "
    "from_tokens (one entry unless the backend switches by token count: auto per token count, "
    "triton-or-deep-gemm); a CUDA-graph bucket runs the entry of its size"
)


class LayerInfo(BaseModel):
    """The layer's MoEConfig (`MoEConfig.as_json`, as in manifest.json), top_k and serving facts."""

    model_config = ConfigDict(extra="forbid")  # a new MoEConfig field must be shown here too

    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: dict[str, str | float]
    routing: dict[str, str | int | float | bool]
    quant: dict[str, str | int]
    dtype: str
    has_bias: bool = Field(description="per-expert biases on both GEMMs")
    apply_router_weight_on_input: bool
    device: str = Field(description="where the layer runs (placed by --devices)")
    device_bytes: int
    shared_experts: bool
    backend: str
    by_tokens: list[TokenRange] = Field(description=BY_TOKENS)
    batch_invariant: bool = Field(
        description="each row's output is independent of its batch (--batch-invariant)"
    )


class LayersResponse(BaseModel):
    layers: list[LayerInfo]


class BackendInfo(BaseModel):
    name: str
    available: bool
    reason: str = Field(description="why it cannot run on this device; empty when available")
    format: str = Field(description="activation format: standard [M, K] or batched [E, max, K]")
    schemes: list[str] = Field(default_factory=list, description="quant schemes (experts only)")
    activations: list[str] = Field(default_factory=list, description="(experts only)")
    batch_invariant: bool = Field(
        False, description="(experts only) has a batch-invariant mode (--batch-invariant)"
    )


class LayerBackend(BaseModel):
    layer: str
    device: str = Field(description="where the layer runs (placed by --devices)")
    experts: str
    prepare_finalize: str
    reason: str = Field(description="why this pair: forced by --backend, or the auto rule")
    rejected: dict[str, str] = Field(description="other experts backends and why not")
    by_tokens: list[TokenRange] = Field(description=BY_TOKENS)
    workspace_bytes: int = Field(description="scratch memory, shared by the layers of its device")
    batch_invariant: bool = Field(
        description="each row's output is independent of its batch (--batch-invariant)"
    )
    graph_buckets: list[int] = Field(
        description="token counts the layer replays from whole-layer CUDA graphs (a batch is "
        "padded to the next); empty: it runs uncaptured (CPU, or a backend that syncs)"
    )


class DeviceInfo(BaseModel):
    type: str
    name: str
    compute_capability: str | None = None
    memory_bytes: int | None = None


class BackendsResponse(BaseModel):
    device: DeviceInfo = Field(
        description="the (first) device the layers are placed on, where the backends' "
        "availability is judged"
    )
    experts: list[BackendInfo]
    prepare_finalize: list[BackendInfo]
    layers: list[LayerBackend]
