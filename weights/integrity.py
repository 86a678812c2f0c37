"""What makes a layer's bytes trustworthy: their checksums match the manifest's, and every value
is finite.

A checksum is the xxh3-64 of a tensor's bytes, one per expert for the tensors with an expert
axis (expert parallelism reads only some experts, and each is checked on its own), one for the
others. xxh3 hashes at memory speed, so the loader checks while it streams the file.
"""

from __future__ import annotations

import torch
import xxhash

from ..kernels.input_checks import NONFINITE_BITS

CHECKSUM = "xxh3-64"
_E8M0_BITS = (torch.uint8, 0xFF)  # an e8m0 scale's one non-finite code is 255
# Elements masked at once, into one reused buffer: bounds the temporary memory, and on the CPU
# keeps it in cache (a fresh allocation per piece costs more in page faults than the test).
_PIECE_ELEMENTS = 1 << 22


class RowDigests:
    """The checksums of consecutive rows of `row_bytes` bytes each, fed in pieces of any size."""

    def __init__(self, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        self.digests: list[str] = []
        self._hash = xxhash.xxh3_64()
        self._filled = 0

    def update(self, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        while data:
            take = min(len(data), self.row_bytes - self._filled)
            self._hash.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self.row_bytes:
                self.digests.append(self._hash.hexdigest())
                self._hash.reset()
                self._filled = 0


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def checksums(t: torch.Tensor, per_expert: bool) -> list[str]:
    """The checksums of CPU tensor `t`: one per row of axis 0 when `per_expert`, else one."""
    rows = t if per_expert else t[None]
    return [xxhash.xxh3_64_hexdigest(_bytes(row)) for row in rows]


def first_nonfinite(t: torch.Tensor, *, e8m0: bool = False) -> list[int] | None:
    """The index of the first NaN or Inf in contiguous `t` (on any device), None when all are
    finite. Floating dtypes (fp8 included) are tested, integer ones hold no such value unless
    `e8m0` says that a uint8 tensor holds e8m0 scales. One device-to-host sync when all are
    finite."""
    bits = _E8M0_BITS if e8m0 else NONFINITE_BITS.get(t.dtype)
    if bits is None:
        return None
    int_dtype, mask = bits
    flat = t.reshape(-1).view(int_dtype)
    buffer = torch.empty(min(_PIECE_ELEMENTS, flat.numel()), dtype=int_dtype, device=t.device)
    pieces = flat.split(_PIECE_ELEMENTS)
    maxima = []
    for piece in pieces:
        masked = torch.bitwise_and(piece, mask, out=buffer[: piece.numel()])
        maxima.append(masked.amax())
    hit = torch.stack(maxima) == mask
    if not hit.any():
        return None
    first = int(hit.nonzero()[0])
    within = int(((pieces[first] & mask) == mask).nonzero()[0])
    flat_index = torch.tensor(first * _PIECE_ELEMENTS + within)
    return [int(i) for i in torch.unravel_index(flat_index, t.shape)]
