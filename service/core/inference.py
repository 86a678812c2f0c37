"""KServe v2 inference whatever the transport: HTTP (service/http/routes/kserve.py) and gRPC
(service/grpc/servicer.py) decode a request into an InferRequest plus tensors, call `infer`, and
encode what it returns.

Each served layer is a model with version 1, inputs hidden_states [-1, H] (and optional
router_logits [-1, E]) and output `output` [-1, H] in the input's datatype. Its metadata and its
Triton model configuration are both read from the layer and the batcher that serve it.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import torch

from ... import __version__
from ..codecs.kserve import (
    DATATYPE_NAMES,
    SHM_BYTE_SIZE,
    SHM_OFFSET,
    SHM_REGION,
    InferOutput,
    InferRequest,
    ModelMetadata,
    ServerMetadata,
    TensorMetadata,
    tensor_type,
)
from ..engine.batcher import RequestOptions
from ..engine.copy_memory import Loan
from ..engine.interface import ServedLayer, ServingEngine
from ..errors import BadInput, PayloadTooLarge
from ..triton.shared_memory import CopyReservation, DeviceRegion, TensorPlace
from ..triton.statistics import VERSION
from .forward import MAX_SCHEDULE_VALUE, TENSOR_NAMES, schedule_options, submit_unless_withdrawn
from .inputs import check_inputs
from .probes import check_version
from .runtime import Runtime, ready

OUTPUT = "output"
PLATFORM = "moe-serve"
# The datatype the metadata and the model configuration name; FP16 and BF16 are taken as well
DATATYPE = "FP32"


@dataclass(frozen=True)
class InferenceResult:
    outputs: dict[str, torch.Tensor]  # to send in the reply (CPU)
    placed: list[InferOutput] = field(default_factory=list)  # written into shared memory


def server_metadata(runtime: Runtime) -> ServerMetadata:
    extensions = ["binary_tensor_data", "schedule_policy", "statistics"]
    if runtime.shared_memory.allowed:
        extensions += ["system_shared_memory", "cuda_shared_memory"]
    if runtime.repository is not None:
        extensions.append("model_repository")
    return ServerMetadata(name="moe-serve", version=__version__, extensions=extensions)


@dataclass(frozen=True)
class Tensor:
    """One of a model's tensors: rows of `width` values, as many rows as the request has."""

    name: str
    width: int
    optional: bool = False


def model_tensors(served: ServedLayer) -> tuple[list[Tensor], list[Tensor]]:
    """The model's (inputs, outputs); router_logits is optional where the layer has a router."""
    cfg = served.config
    inputs = [
        Tensor("hidden_states", cfg.hidden_size),
        Tensor("router_logits", cfg.num_experts, optional=served.has_router),
    ]
    return inputs, [Tensor(OUTPUT, cfg.hidden_size)]


def model_metadata(served: ServedLayer) -> ModelMetadata:
    inputs, outputs = model_tensors(served)
    return ModelMetadata(
        name=served.name,
        versions=[VERSION],
        platform=PLATFORM,
        inputs=[
            TensorMetadata(name=t.name, datatype=DATATYPE, shape=[-1, t.width]) for t in inputs
        ],
        outputs=[
            TensorMetadata(name=t.name, datatype=DATATYPE, shape=[-1, t.width]) for t in outputs
        ],
    )


def model_config(runtime: Runtime, name: str, version: str = "") -> dict:
    """Model `name`'s configuration in Triton's schema (model_config.proto, as Triton's HTTP API
    prints it), read from what serves it. The rows of a request are Triton's batch dimension:
    max_batch_size is the batcher's rows per forward (a larger request runs in pieces), dims
    leave the batch out. Priorities are Triton's unsigned 64-bit levels, 1 first and 0 (the
    default) after every numbered one; a request's queue timeout may be set per request."""
    runtime = ready(runtime)
    served = get_model(runtime.engine, name, version)
    policy, device = runtime.batcher.policy, served.device
    inputs, outputs = model_tensors(served)
    on_gpu = device.type == "cuda"
    return {
        "name": served.name,
        "platform": PLATFORM,
        "backend": served.backend,
        "version_policy": {"specific": {"versions": [int(VERSION)]}},
        "max_batch_size": policy.max_batch_tokens,
        "input": [
            {
                "name": t.name,
                "data_type": f"TYPE_{DATATYPE}",
                "format": "FORMAT_NONE",
                "dims": [t.width],
                "optional": t.optional,
            }
            for t in inputs
        ],
        "output": [
            {"name": t.name, "data_type": f"TYPE_{DATATYPE}", "dims": [t.width]} for t in outputs
        ],
        "dynamic_batching": {
            "max_queue_delay_microseconds": round(policy.max_delay_s * 1e6),
            "priority_levels": MAX_SCHEDULE_VALUE,
            "default_priority_level": MAX_SCHEDULE_VALUE,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": 0,
                "allow_timeout_override": True,
                "max_queue_size": policy.max_queue,
            },
        },
        "instance_group": [
            {
                "name": served.name,
                "kind": "KIND_GPU" if on_gpu else "KIND_CPU",
                "count": 1,
                **({"gpus": [device.index or 0]} if on_gpu else {}),
            }
        ],
    }


def get_model(engine: ServingEngine, name: str, version: str = "") -> ServedLayer:
    """The served layer `name`; `version` is empty (any) or VERSION."""
    served = engine.get(name)  # an unknown model first
    check_version(name, version)
    return served


async def infer(
    runtime: Runtime,
    name: str,
    version: str,
    request: InferRequest,
    tensors: dict[str, torch.Tensor],
    owner: str | None = None,
    withdrawn: asyncio.Future | None = None,
) -> InferenceResult:
    """One inference request: `tensors` are its inputs decoded from the body, by name; inputs
    and outputs that name a shared-memory region are read from and written to it. `owner`:
    who may use the regions (shared_memory.owner_of). `withdrawn`: done once an HTTP client has
    gone away, which withdraws the request (a gRPC call is cancelled instead, which withdraws it
    too)."""
    runtime = ready(runtime)
    served = get_model(runtime.engine, name, version)
    # CUDA regions it views, the room of what it copied out of system regions and the copy
    # memory it holds: released once it is done
    held: list[DeviceRegion | CopyReservation | Loan] = []
    try:
        with runtime.metrics.statistics.request(name) as timer:
            tensors = tensors | await _read_shared_memory(runtime, request, owner, held)
            unknown = sorted(set(tensors) - set(TENSOR_NAMES))
            if unknown:
                known = list(TENSOR_NAMES)
                raise BadInput(f"unknown inputs {unknown}; model {name!r} takes {known}")
            if "hidden_states" not in tensors:
                raise BadInput("input hidden_states is missing")
            hidden = tensors["hidden_states"]
            inputs = check_inputs(served, hidden, tensors.get("router_logits"))
            # into: what the forward writes the output into (a CUDA region's view, or, for a
            # system region, copy memory: `copied` the loan of it)
            place, into, copied = _output_place(runtime, request, name, hidden, owner, held)
            options = schedule_policy(request.parameters)
            timer.submit(hidden.shape[0])
            if withdrawn is None:
                result = await runtime.batcher.submit(name, inputs, options, into)
            else:
                result = await submit_unless_withdrawn(
                    runtime.batcher, name, inputs, options, withdrawn, into
                )
            timer.answer()
            if place is None:
                return InferenceResult({OUTPUT: result.output.to(hidden.dtype)})
            if copied is not None:  # the output's bytes are in it (the batcher's `into`)
                shm, alone = runtime.shared_memory, runtime.batcher.idle
                await shm.write(f"output {OUTPUT}", place, copied.raw, owner, alone)
            return InferenceResult({}, [_placed(place, hidden)])
    finally:
        for region in held:  # the batcher returns once no device copy uses them
            region.release()


def schedule_policy(parameters: dict[str, object]) -> RequestOptions:
    """The request parameters `priority` and `timeout` (microseconds) of Triton's schedule
    policy extension; absent or 0: the default."""
    values = {}
    for key in ("priority", "timeout"):
        value = parameters.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadInput(f"parameters.{key} must be an integer >= 0, got {value!r}")
        if value > MAX_SCHEDULE_VALUE:
            raise BadInput(
                f"parameters.{key} is out of range: an integer from 0 to 2^64 - 1 (Triton's), "
                f"got {value!r}"
            )
        values[key] = value
    return schedule_options(values["priority"], values["timeout"])


async def _read_shared_memory(
    runtime: Runtime,
    request: InferRequest,
    owner: str | None,
    held: list[DeviceRegion | CopyReservation | Loan],
) -> dict[str, torch.Tensor]:
    """The inputs that name a region: views of a CUDA region (on its GPU), or tensors of the
    bytes read from a system region into copy memory (pinned where the engine runs on a GPU,
    which copies them to the device from there). What is copied out of system regions counts
    against the body limit, as if the client had sent it: it costs the server's memory all the
    same; and against what all requests in flight may hold (SharedMemory.reserve_copies). The
    server's only request copies larger inputs on the event loop (service/off_loop.py)."""
    tensors, copies = {}, []
    shm, limit = runtime.shared_memory, runtime.settings.max_body_bytes
    for t in request.inputs:
        what = f"input {t.name}"
        place = TensorPlace.of(what, t.parameters)
        if place is None:
            continue
        dtype, shape = tensor_type(t)
        view = shm.view(what, place, dtype, shape, owner, True, held)
        if view is None:
            copies.append((t.name, what, place, dtype, shape))
        else:
            tensors[t.name] = view
    copied = sum(math.prod(shape) * dtype.itemsize for *_, dtype, shape in copies)
    if copied > limit:
        raise PayloadTooLarge(
            f"inputs of {copied} bytes in system shared memory exceed the {limit}-byte limit "
            "of a request (MOE_SERVE_MAX_BODY_BYTES)"
        )
    if copied:
        held.append(shm.reserve_copies(copied))
    pinned, alone = runtime.engine.enqueues, runtime.batcher.idle
    for name, what, place, dtype, shape in copies:
        tensors[name] = await shm.read(what, place, dtype, shape, owner, held, pinned, alone)
    return tensors


def _output_place(
    runtime: Runtime,
    request: InferRequest,
    name: str,
    hidden: torch.Tensor,
    owner: str | None,
    held: list[DeviceRegion | CopyReservation | Loan],
) -> tuple[TensorPlace | None, torch.Tensor | None, Loan | None]:
    """Where the output goes: (None, None, None) in the reply; else its shared-memory place,
    checked before the forward so that an output that cannot fit fails first, the tensor the
    forward writes it into in the request's dtype (a CUDA region's view; for a system region
    copy memory, pinned where the engine runs on a GPU, which casts and copies the output
    there) and the loan of that copy memory, written into the region once the forward is
    done."""
    place = into = None
    shm, nbytes = runtime.shared_memory, hidden.numel() * hidden.itemsize
    for i, requested in enumerate(request.outputs or ()):
        if requested.name != OUTPUT:
            raise BadInput(f"unknown output {requested.name!r}; model {name!r} has {OUTPUT!r}")
        if i:  # the one output, named again: which entry's place and parameters hold?
            raise BadInput(f"output {OUTPUT} is requested twice")
        if requested.parameters.get("classification", 0):  # an extension not advertised
            raise BadInput(f"output {OUTPUT}: classification is not supported (the tensor only)")
        what = f"output {requested.name}"
        place, into = TensorPlace.of(what, requested.parameters), None
        if place is not None:
            into = shm.view(what, place, hidden.dtype, hidden.shape, owner, False, held)
            if into is None:
                shm.check(what, place, nbytes, owner, exact=False)
    if place is None or into is not None:
        return place, into, None
    loan = shm.copy_memory.lend(nbytes, runtime.engine.enqueues)
    held.append(loan)
    return place, loan.view(hidden.dtype, hidden.shape), loan


def _placed(place: TensorPlace, hidden: torch.Tensor) -> InferOutput:
    """The output written at `place` (as big as the input, in its datatype), as the reply lists
    it."""
    parameters = {SHM_REGION: place.region, SHM_BYTE_SIZE: hidden.numel() * hidden.itemsize}
    if place.offset:
        parameters[SHM_OFFSET] = place.offset
    return InferOutput(
        name=OUTPUT,
        shape=list(hidden.shape),
        datatype=DATATYPE_NAMES[hidden.dtype],
        parameters=parameters,
    )


def statistics(runtime: Runtime, name: str = "", version: str = "") -> dict:
    """Triton's $stats_model_response: every model, or model `name` (of `version`)."""
    engine = ready(runtime).engine
    names = [get_model(engine, name, version).name] if name else sorted(engine.layers)
    stats = runtime.metrics.statistics.to_json(names)
    for model in stats["model_stats"]:  # the layer's weights, on its device
        served = engine.layers[model["name"]]
        model["memory_usage"] = [
            {
                "type": "GPU" if served.device.type == "cuda" else "CPU",
                "id": served.device.index or 0,
                "byte_size": served.device_bytes,
            }
        ]
    return stats
