"""Whether every floating-point value of a safetensors body is finite, read with numpy in place
(torch-free: an HTTP front-end process checks each binary forward's body before the engine sees
it, so the engine, which serves every front end, need not read the values again)."""

from __future__ import annotations

import numpy as np

from kernels.nonfinite import NONFINITE_MASKS
from service.safetensors_header import read_header

_BITS = {"F64": np.int64, "F32": np.int32, "BF16": np.int16, "F16": np.int16, "F8_E4M3": np.uint8}
_CHUNK_BYTES = 1 << 20  # scratch reused chunk by chunk: no fresh pages per request


class FiniteCheck:
    """One process's checker, with its scratch buffer."""

    def __init__(self) -> None:
        self._scratch = np.empty(_CHUNK_BYTES, dtype=np.uint8)

    def __call__(self, body: bytes | memoryview) -> bool:
        """True when `body` is a safetensors blob whose float values are all finite; False
        also for a blob that cannot be read (the engine then says what is wrong with it)."""
        try:
            header = read_header(body)
        except ValueError:
            return False
        data = memoryview(body)[header.data_start :]
        for entry in header.entries:
            bits = _BITS.get(entry.dtype)
            if bits is None or not entry.numel:
                continue
            mask = NONFINITE_MASKS[entry.dtype]
            values = np.frombuffer(data, dtype=bits, count=entry.numel, offset=entry.begin)
            scratch = self._scratch.view(bits)
            for start in range(0, values.size, scratch.size):
                chunk = values[start : start + scratch.size]
                masked = np.bitwise_and(chunk, bits(mask), out=scratch[: chunk.size])
                if masked.max() == mask:
                    return False
        return True
