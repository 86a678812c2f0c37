"""The /v1 forward whatever the transport: a body (JSON or a safetensors blob) decoded and
checked, the batcher's answer, the reply encoded. The HTTP route (service/http/routes/forward.py)
and the front-end channel (service/frontends/channel_server.py) call it; KServe inference
(inference.py) submits through `submit_unless_withdrawn` too.

A request is withdrawn from the batcher (its waiting rows leave the queue) once the future its
transport passes in is done: the client went away.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from ...kernels.layer import LayerOutput
from ...kernels.tensors import ForwardInputs
from ..codecs import json_device, json_numbers, json_tensors
from ..codecs.safetensors_wire import (
    decode_safetensors,
    safetensors_head,
    safetensors_parts,
    tensor_bytes,
)
from ..engine.batcher import DynamicBatcher, RequestOptions
from ..engine.interface import ServedLayer
from ..errors import BadInput, ClientDisconnected, ServiceError
from ..metrics import Metrics
from ..off_loop import BINARY, JSON
from .inputs import check_inputs
from .runtime import Runtime

TENSOR_NAMES = ("hidden_states", "router_logits")
# The largest `priority` and `timeout` (microseconds): Triton's are unsigned 64-bit integers. A
# larger timeout would not even convert to seconds as a float.
MAX_SCHEDULE_VALUE = 2**64 - 1


@dataclass(frozen=True)
class LayerCall:
    """What one forward of a layer goes through: the layer, the batcher that runs it, the
    metrics that count it."""

    served: ServedLayer
    batcher: DynamicBatcher
    metrics: Metrics

    @classmethod
    def of(cls, runtime: Runtime, name: str) -> LayerCall:
        """Layer `name` of a ready runtime (UnknownLayer, 404, if it has none)."""
        return cls(runtime.engine.get(name), runtime.batcher, runtime.metrics)


def schedule_options(priority: int, timeout_us: int) -> RequestOptions:
    """KServe/Triton schedule-policy values -> the batcher's options (0: the default)."""
    return RequestOptions(priority, timeout_us / 1e6 if timeout_us else None)


async def serve_json(
    call: LayerCall,
    body: bytes | memoryview,
    options: RequestOptions,
    withdrawn: asyncio.Future,
    room: memoryview | None = None,
) -> list[bytes | memoryview]:
    """A JSON body -> the JSON reply's pieces, in order (a large reply's text is not joined into
    one copy). On a GPU engine a large body is parsed, and its 16-bit output printed, on the
    device (service/codecs/json_device.py), the body copied there from where it lies; with
    `room` (pinned memory, the room after the body's), the printed reply is copied straight
    there, where it fits, and sent from it."""
    written = await _serve_json(call, body, options, withdrawn, room)
    return [room[:written]] if isinstance(written, int) else written


async def serve_json_into(
    call: LayerCall, body: memoryview, reply: memoryview, withdrawn: asyncio.Future
) -> int | list[bytes | memoryview]:
    """A JSON body -> its reply written into `reply` (a 16-bit output printed on the device
    straight into it); the reply's size, or, where it is longer than `reply`, its pieces."""
    written = await _serve_json(call, body, RequestOptions(), withdrawn, reply)
    if isinstance(written, int):
        return written
    size = sum(map(len, written))
    if size > len(reply):
        return written
    await BINARY.run(size, copy_parts, written, reply)
    return size


async def _serve_json(
    call: LayerCall,
    body: bytes | memoryview,
    options: RequestOptions,
    withdrawn: asyncio.Future,
    into: memoryview | None,
) -> int | list[bytes | memoryview]:
    """serve_json, or, with `into`, what `_encode_json` writes there."""
    served, metrics = call.served, call.metrics
    device = served.device
    if device.type != "cuda" or not json_device.worth_it(len(body)):
        device = None
    started = time.perf_counter()
    if device is not None:  # the reading waits for the device: never on the event loop
        inputs, want_routing = await JSON.off_loop(_decode_json, served, body, device)
    else:
        inputs, want_routing = await JSON.run(len(body), _decode_json, served, body, None)
    metrics.observe_stage(served.name, "decode", time.perf_counter() - started)
    hidden = inputs.hidden_states
    output = torch.empty_like(hidden, dtype=served.config.dtype) if hidden.is_cuda else None
    result = await submit_unless_withdrawn(
        call.batcher, served.name, inputs, options, withdrawn, output
    )
    started = time.perf_counter()
    if _printed_on_device(result.output):  # it waits for the device: never on the event loop
        reply = await JSON.off_loop(_encode_json, served, result, want_routing, into)
    else:
        numbers = result.output.numel()
        numbers += 2 * result.routing.topk_ids.numel() if want_routing else 0
        nbytes = numbers * json_numbers.NUMBER_BYTES
        reply = await JSON.run(nbytes, _encode_json, served, result, want_routing, into)
    metrics.observe_stage(served.name, "encode", time.perf_counter() - started)
    return reply


async def serve_blob(
    call: LayerCall,
    body: bytes | memoryview,
    options: RequestOptions,
    return_routing: bool,
    withdrawn: asyncio.Future,
) -> list[bytes | memoryview]:
    """A safetensors body -> the reply blob's pieces (the tensors' bytes are never joined)."""
    served = call.served
    started = time.perf_counter()
    inputs = await BINARY.run(len(body), _decode_blob, served, body)
    call.metrics.observe_stage(served.name, "decode", time.perf_counter() - started)
    result = await submit_unless_withdrawn(call.batcher, served.name, inputs, options, withdrawn)
    return await _encode_timed(call, result, inputs.hidden_states.dtype, return_routing)


async def serve_blob_into(
    call: LayerCall,
    body: memoryview,
    reply: memoryview,
    pinned: bool,
    withdrawn: asyncio.Future,
    layer_dtype: bool = False,
) -> int:
    """A safetensors body -> its reply blob written into `reply`; the reply's size. `pinned`:
    both lie in memory registered with CUDA; `layer_dtype`: the output in the layer's dtype, not
    the request's (a front end writes it as JSON in that dtype's shortest form).

    Where the engine runs batches on a GPU and the request's dtype is the layer's, the body is
    copied to the device from where it lies and the output from the device straight into
    `reply` (only the small header is written here); elsewhere the reply is encoded and copied
    in."""
    served, batcher, metrics = call.served, call.batcher, call.metrics
    name = served.name
    started = time.perf_counter()
    inputs = await BINARY.run(len(body), _decode_blob, served, body)
    metrics.observe_stage(name, "decode", time.perf_counter() - started)
    hidden = inputs.hidden_states
    options = RequestOptions()
    if not (pinned and batcher.engine.enqueues and hidden.dtype == served.config.dtype):
        result = await submit_unless_withdrawn(batcher, name, inputs, options, withdrawn)
        wire = served.config.dtype if layer_dtype else hidden.dtype
        parts = await _encode_timed(call, result, wire, False)
        size = sum(map(len, parts))
        _check_fits(size, len(reply))
        await BINARY.run(size, copy_parts, parts, reply)
        return size
    tokens, width = hidden.shape
    head = _reply_head(served.name, served.backend, hidden.dtype, tokens, width)
    size = len(head) + hidden.numel() * hidden.element_size()
    _check_fits(size, len(reply))
    reply[: len(head)] = head
    output = torch.frombuffer(reply, dtype=hidden.dtype, count=hidden.numel(), offset=len(head))
    output = output.view(tokens, width)  # [T, H], after the header
    await submit_unless_withdrawn(batcher, name, inputs, options, withdrawn, output)
    return size


async def submit_unless_withdrawn(
    batcher: DynamicBatcher,
    name: str,
    inputs: ForwardInputs,
    options: RequestOptions,
    withdrawn: asyncio.Future,
    output_into: torch.Tensor | None = None,
) -> LayerOutput:
    """batcher.submit in the caller's own task: once `withdrawn` is done, that task is cancelled
    while it waits in batcher.submit (which then returns once the device is done with the
    request's buffers: `output_into`, inputs on a GPU or in pinned memory) and
    ClientDisconnected raised; a task cancelled from elsewhere stays cancelled. One task per
    request: a second task, a watcher and asyncio.wait per request cost the event loop more
    (`bench/channel_bench.py`)."""
    task = asyncio.current_task()
    submitting, cancelled_here = True, False

    def withdraw(_: asyncio.Future) -> None:
        nonlocal cancelled_here
        if submitting and not cancelled_here:
            cancelled_here = True
            task.cancel()

    withdrawn.add_done_callback(withdraw)
    try:
        return await batcher.submit(name, inputs, options, output_into)
    except asyncio.CancelledError:
        if cancelled_here and task.uncancel() == 0:
            raise ClientDisconnected(
                f"the client went away; its request to layer {name!r} was withdrawn"
            ) from None
        raise
    finally:
        submitting = False
        withdrawn.remove_done_callback(withdraw)


async def _encode_timed(
    call: LayerCall, result: LayerOutput, wire: torch.dtype, return_routing: bool
) -> list[bytes | memoryview]:
    started = time.perf_counter()
    parts = await BINARY.run(
        result.output.numel() * wire.itemsize,
        _encode_blob,
        call.served,
        result,
        wire,
        return_routing,
    )
    call.metrics.observe_stage(call.served.name, "encode", time.perf_counter() - started)
    return parts


def _check_fits(size: int, room: int) -> None:
    if size > room:
        raise ServiceError(f"the reply of {size} bytes does not fit its {room}-byte room")


def copy_parts(parts: list[bytes | memoryview], out: memoryview) -> None:
    """A reply's pieces, one after the other, into `out`."""
    at = 0
    for part in parts:
        out[at : at + len(part)] = part
        at += len(part)


def _load_blob(body: bytes | memoryview) -> dict:
    try:
        tensors = decode_safetensors(body)
    except ValueError as err:
        raise BadInput(f"body is not a valid safetensors blob: {err}") from None
    unknown = sorted(set(tensors) - set(TENSOR_NAMES))
    if unknown:
        listed = ", ".join(unknown[:3]) + (
            f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        )
        raise BadInput(f"unknown tensors in the blob: {listed}; expected {list(TENSOR_NAMES)}")
    if "hidden_states" not in tensors:
        raise BadInput("the blob has no hidden_states tensor")
    return tensors


def _decode_blob(served: ServedLayer, body: bytes | memoryview) -> ForwardInputs:
    tensors = _load_blob(body)
    return check_inputs(served, tensors["hidden_states"], tensors.get("router_logits"))


def _encode_blob(
    served: ServedLayer, result: LayerOutput, wire: torch.dtype, routing: bool
) -> list[bytes | memoryview]:
    output = result.output.to(wire)  # the request's dtype (no copy when it is the layer's)
    if not routing:  # the usual reply: its header made once per shape
        head = _reply_head(served.name, served.backend, wire, *output.shape)
        return [head, tensor_bytes(output)]
    out = {"output": output}
    out |= {"topk_ids": result.routing.topk_ids, "topk_weights": result.routing.topk_weights}
    return safetensors_parts(out, _reply_metadata(served.name, served.backend, len(output)))


def _reply_metadata(layer: str, backend: str, tokens: int) -> dict[str, str]:
    return {"layer": layer, "backend": backend, "tokens": str(tokens)}


@lru_cache(maxsize=1024)
def _reply_head(layer: str, backend: str, dtype: torch.dtype, tokens: int, width: int) -> bytes:
    """The header of a reply written in place: the same for every request of a shape, made
    once (`bench/request_path.py` times the encode it saves)."""
    return safetensors_head(
        {"output": (dtype, [tokens, width])}, _reply_metadata(layer, backend, tokens)
    )


def _decode_json(
    served: ServedLayer, body: bytes | memoryview, device: torch.device | None
) -> tuple[ForwardInputs, bool]:
    """`device`: parse there where json_device can (the host path decodes the rest, and names
    what is wrong; from bytes: a body in shared or pinned memory is copied for it)."""
    parsed = None if device is None else json_device.decode_forward(body, device)
    if parsed is not None:
        return check_inputs(served, parsed.hidden_states, None), parsed.return_routing
    decoded = json_tensors.decode_forward(bytes(body))
    inputs = check_inputs(served, decoded.hidden_states, decoded.router_logits)
    return inputs, decoded.return_routing


def _printed_on_device(output: torch.Tensor) -> bool:
    """Whether a reply's output is printed on the device: 16-bit, there, and large enough."""
    size = output.numel() * json_numbers.NUMBER_BYTES
    return output.is_cuda and output.element_size() == 2 and json_device.worth_it(size)


def _encode_json(
    served: ServedLayer, result: LayerOutput, routing: bool, into: memoryview | None = None
) -> int | list[bytes | memoryview]:
    """The reply's pieces as ForwardResponse describes it, written from the tensors' buffers (a
    16-bit output still on the device printed there); with `into`, a reply printed on the device
    is written into it where it fits, and its size returned instead."""
    output = result.output
    rest = {"layer": served.name, "tokens": output.shape[0], "backend": served.backend}
    if routing:
        rest |= {"topk_ids": result.routing.topk_ids, "topk_weights": result.routing.topk_weights}
    if _printed_on_device(output):
        if into is not None:
            return json_device.print_reply_into(output, rest, into)
        return json_device.print_reply(output, rest)
    return [json_tensors.dumps({"output": output} | rest)]
