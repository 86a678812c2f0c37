"""KServe v2 inference whatever the transport: HTTP (routes/kserve.py) and gRPC (grpc_server.py)
decode a request into an InferRequest plus tensors, call `infer`, and encode what it returns.

Each served layer is a model with version 1, inputs hidden_states [-1, H] (and optional
router_logits [-1, E]) and output `output` [-1, H] in the input's datatype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from service import __version__
from service.deps import Runtime, ready
from service.engine import Engine, ServedLayer
from service.errors import BadInput, UnknownLayer
from service.inputs import check_inputs
from service.kserve_codec import (
    InferOutput,
    InferRequest,
    ModelMetadata,
    ServerMetadata,
    TensorMetadata,
)
from service.routes.forward import TENSOR_NAMES

OUTPUT = "output"
VERSION = "1"  # a layer is a model with one version; clients may name it or not
PLATFORM = "moe-serve"


@dataclass(frozen=True)
class InferenceResult:
    outputs: dict[str, torch.Tensor]  # to send in the reply (CPU)
    placed: list[InferOutput] = field(default_factory=list)  # written into shared memory


def server_metadata() -> ServerMetadata:
    return ServerMetadata(name="moe-serve", version=__version__, extensions=["binary_tensor_data"])


def model_metadata(served: ServedLayer) -> ModelMetadata:
    cfg = served.config
    return ModelMetadata(
        name=served.name,
        versions=[VERSION],
        platform=PLATFORM,
        inputs=[
            TensorMetadata(name="hidden_states", datatype="FP32", shape=[-1, cfg.hidden_size]),
            TensorMetadata(name="router_logits", datatype="FP32", shape=[-1, cfg.num_experts]),
        ],
        outputs=[TensorMetadata(name=OUTPUT, datatype="FP32", shape=[-1, cfg.hidden_size])],
    )


def get_model(engine: Engine, name: str, version: str = "") -> ServedLayer:
    """The served layer `name`; `version` is empty (any) or VERSION."""
    served = engine.get(name)  # an unknown model first
    if version not in ("", VERSION):
        raise UnknownLayer(f"model {name!r} has version {VERSION} only, not {version!r}")
    return served


async def infer(
    runtime: Runtime,
    name: str,
    version: str,
    request: InferRequest,
    tensors: dict[str, torch.Tensor],
) -> InferenceResult:
    """One inference request: `tensors` are its inputs decoded from the body, by name."""
    runtime = ready(runtime)
    served = get_model(runtime.engine, name, version)
    unknown = sorted(set(tensors) - set(TENSOR_NAMES))
    if unknown:
        raise BadInput(f"unknown inputs {unknown}; model {name!r} takes {list(TENSOR_NAMES)}")
    if "hidden_states" not in tensors:
        raise BadInput("input hidden_states is missing")
    for requested in request.outputs or ():
        if requested.name != OUTPUT:
            raise BadInput(f"unknown output {requested.name!r}; model {name!r} has {OUTPUT!r}")
    hidden = tensors["hidden_states"]
    inputs = check_inputs(served, hidden, tensors.get("router_logits"))
    result = await runtime.batcher.submit(name, inputs)
    return InferenceResult({OUTPUT: result.output.to(hidden.dtype)})
