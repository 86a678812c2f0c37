"""Request tensors that live on a GPU (views of a client's CUDA shared-memory region): inputs the
device pipeline copies device to device into its staging buffers, and an output buffer the
forward's rows are copied into, device to device, before the batch counts as done.

The batcher treats such a request as any other (its rows are sliced with `rows_of`); only the
staging (service/pipeline.py) and the synchronous forward (Engine._run_now) look here. Batches
may mix these with host requests: host rows are staged and copied in as before, device rows are
copied over them on the copy-in stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kernels.layer import LayerOutput
from kernels.tensors import ForwardInputs


@dataclass(frozen=True)
class PlacedInputs(ForwardInputs):
    """ForwardInputs (on any device) whose output rows go into `output_into` [T, H] (in its own
    dtype, on any device), written by the forward's device work before its result returns."""

    output_into: torch.Tensor | None = None


def rows_of(inputs: ForwardInputs, rows: slice) -> ForwardInputs:
    """`rows` of each of the inputs' tensors (views), as the same class."""
    tensors = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    return dataclasses.replace(
        inputs, **{name: t[rows] for name, t in tensors.items() if t is not None}
    )


def on_device(part: ForwardInputs) -> bool:
    return part.hidden_states.device.type != "cpu"


def batch_rows(parts: Sequence[ForwardInputs]) -> Iterator[tuple[slice, ForwardInputs]]:
    """Each part with its rows in the batch."""
    start = 0
    for part in parts:
        rows = part.hidden_states.shape[0]
        yield slice(start, start + rows), part
        start += rows


def device_parts(parts: Sequence[ForwardInputs]) -> list[tuple[slice, ForwardInputs]]:
    """The parts whose inputs are on a GPU, with their rows in the batch."""
    return [(rows, part) for rows, part in batch_rows(parts) if on_device(part)]


def output_sinks(parts: Sequence[ForwardInputs]) -> list[tuple[slice, torch.Tensor]]:
    """(rows in the batch, the buffer they go into) of each part that names one."""
    return [
        (rows, part.output_into)
        for rows, part in batch_rows(parts)
        if isinstance(part, PlacedInputs) and part.output_into is not None
    ]


def stage_host_rows(
    parts: Sequence[ForwardInputs], hidden: torch.Tensor, logits: torch.Tensor | None
) -> None:
    """The host parts' rows into the (pinned) staging buffers, each at its rows of the batch,
    cast to the buffers' dtypes; the rows of device parts are left for `copy_device_rows`."""
    for rows, part in batch_rows(parts):
        if not on_device(part):
            hidden[rows].copy_(part.hidden_states)
            if logits is not None:
                logits[rows].copy_(part.router_logits)


def copy_device_rows(
    parts: list[tuple[slice, ForwardInputs]], hidden: torch.Tensor, logits: torch.Tensor | None
) -> None:
    """The device parts' rows into the device staging buffers, cast to their dtypes, on the
    current stream (a part on another GPU: a peer copy ordered with it by torch)."""
    for rows, part in parts:
        hidden[rows].copy_(part.hidden_states)
        if logits is not None:
            logits[rows].copy_(part.router_logits)


def copy_outputs(sinks: list[tuple[slice, torch.Tensor]], output: torch.Tensor) -> None:
    """The batch's output rows (on the device) into each sink, on the current stream: an event
    recorded after this marks them written."""
    for rows, into in sinks:
        into.copy_(output[rows])


def write_outputs(parts: Sequence[ForwardInputs], outputs: Sequence[LayerOutput]) -> None:
    """Each part's output rows (host tensors, one per part) into its `output_into`; returns once
    they are there (a copy to the GPU from pageable memory waits for itself)."""
    for part, out in zip(parts, outputs, strict=True):
        if isinstance(part, PlacedInputs) and part.output_into is not None:
            part.output_into.copy_(out.output)
