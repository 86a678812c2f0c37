"""Which device serves each layer (`--devices`): over several GPUs, by memory. The largest
layers go first, each onto the device with the most memory left free by the layers placed
before it, so that the free memory left is balanced over the devices. The weights are what is
counted; a layer's workspace, staging buffers and CUDA graphs come on top."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ...weights.load import read_manifest, weight_bytes

GIB = 1 << 30


def free_bytes(device: torch.device) -> int:
    """Memory `device` (a GPU) has for new weights: free on the device, and what torch's
    allocator holds there unused."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def place_layers(
    sizes: Mapping[str, int], free: Mapping[torch.device, int]
) -> dict[str, torch.device]:
    """Each layer (name -> weight bytes) onto a device (device -> free bytes): the largest
    first, each onto the device with the most bytes left (the first of them in `free`'s order
    on a tie). A layer that no device has room for is a ValueError naming it and its bytes."""
    left = dict(free)
    placed: dict[str, torch.device] = {}
    for name, size in sorted(sizes.items(), key=lambda item: -item[1]):
        device = max(left, key=left.__getitem__)
        if size > left[device]:
            raise ValueError(_no_room(name, size, free, left))
        placed[name] = device
        left[device] -= size
    return {name: placed[name] for name in sizes}


def _no_room(
    name: str, size: int, free: Mapping[torch.device, int], left: Mapping[torch.device, int]
) -> str:
    needs = f"layer {name!r} needs {size / GIB:.2f} GiB for its weights"
    if size > max(free.values()):
        return f"{needs}, more than any device has free ({_listed(free)})"
    return f"{needs}; the larger layers leave no device that much ({_listed(left)} left)"


def _listed(free: Mapping[torch.device, int]) -> str:
    return ", ".join(f"{device} {nbytes / GIB:.2f} GiB" for device, nbytes in free.items())


def place_directories(paths: Sequence[Path], devices: Sequence[torch.device]) -> list[torch.device]:
    """The device of each layer directory in `paths`: the one device there is, or over several
    by the weight bytes its manifest names against each device's free memory (`place_layers`)."""
    if len(devices) == 1:
        return [devices[0]] * len(paths)
    sizes = {str(path): weight_bytes(read_manifest(path)) for path in paths}
    where = place_layers(sizes, {device: free_bytes(device) for device in devices})
    return [where[str(path)] for path in paths]
