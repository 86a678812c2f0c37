"""Rows of 16-bit floats printed as the JSON array `[[1.5,-2.0],[0.0,4.0]]` on a GPU by two
Triton kernels and one torch op. Each value's text comes from its dtype's table (the 65,536
values as the host path prints them, `json_device._number_table`); the values are cut into
blocks of BLOCK_VALUES, and

1. `_size_kernel` sums the bytes each block prints: a value's text, the `,` or `]` after it, and
   the `[` before a row and the `,` or `]` after it;
2. their cumulative sum over the blocks (torch) gives each block where its text begins;
3. `_write_kernel` writes each value's text and the brackets and commas around it there, and
   the last block the text's length.

The launches and the host's read of the length queue on one stream, so the host waits once. The
kernels are compiled once for every shape (no specialisation on it), at warm-up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_VALUES = 256
_WARPS = 4
OPEN = tl.constexpr(91)  # "["
CLOSE = tl.constexpr(93)  # "]"
COMMA = tl.constexpr(44)  # ","


@triton.jit
def _sizes(values_ptr, lengths_ptr, n, width, BLOCK: tl.constexpr):
    """A block's values: their flat index, table index (their bits), text length, column and
    bytes printed (the text, what follows it, and the row's brackets and comma)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    bits = tl.load(values_ptr + i, mask=inside, other=0).to(tl.int32) & 0xFFFF
    length = tl.load(lengths_ptr + bits, mask=inside, other=0)
    column = i % width
    size = length + 1 + (column == 0).to(tl.int32) + (column == width - 1).to(tl.int32)
    return i, inside, bits, length, column, tl.where(inside, size, 0)


@triton.jit(do_not_specialize=["n", "width"])
def _size_kernel(values_ptr, lengths_ptr, block_bytes_ptr, n, width, BLOCK: tl.constexpr):
    _, _, _, _, _, size = _sizes(values_ptr, lengths_ptr, n, width, BLOCK)
    tl.store(block_bytes_ptr + tl.program_id(0), tl.sum(size.to(tl.int64), axis=0))


@triton.jit(do_not_specialize=["n", "width", "blocks"])
def _write_kernel(
    values_ptr,
    lengths_ptr,
    chars_ptr,
    ends_ptr,  # int64 [blocks]: where each block's text ends, less the text's opening "["
    out_ptr,
    length_ptr,
    n,
    width,
    blocks,
    BLOCK: tl.constexpr,
    CHARS: tl.constexpr,
):
    pid = tl.program_id(0)
    i, inside, bits, length, column, size = _sizes(values_ptr, lengths_ptr, n, width, BLOCK)
    before = tl.load(ends_ptr + pid - 1, mask=pid > 0, other=0)
    start = 1 + before + tl.cumsum(size.to(tl.int64), axis=0) - size  # where a value's bytes go
    first = start + (column == 0).to(tl.int64)
    chars = tl.arange(0, CHARS)
    text = tl.load(chars_ptr + bits[:, None] * CHARS + chars[None, :])
    tl.store(
        out_ptr + first[:, None] + chars[None, :],
        text,
        mask=inside[:, None] & (chars[None, :] < length[:, None]),
    )
    last = column == width - 1
    tl.store(out_ptr + start, OPEN, mask=inside & (column == 0))
    tl.store(out_ptr + first + length, tl.where(last, CLOSE, COMMA).to(tl.uint8), mask=inside)
    after_row = tl.where(i == n - 1, CLOSE, COMMA).to(tl.uint8)
    tl.store(out_ptr + first + length + 1, after_row, mask=inside & last)
    if pid == 0:
        tl.store(out_ptr, OPEN)
    if pid == blocks - 1:
        tl.store(length_ptr, 1 + tl.load(ends_ptr + pid))


def write_rows(
    values: torch.Tensor, chars: torch.Tensor, lengths: torch.Tensor, block: int = BLOCK_VALUES
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, W] of a 16-bit dtype (T, W >= 1), on a GPU or in Triton's interpreter, and its
    dtype's table (uint8 [65536, a power of two] zero padded, int32 [65536]) -> uint8 text
    (room for the longest: its first bytes are the rows' JSON) and int64 [1], the text's
    length. Both stay on the values' device, written once the launches run."""
    rows, width = values.shape
    n = rows * width
    dev = values.device
    flat = values.reshape(-1).view(torch.int16)
    blocks = triton.cdiv(n, block)
    block_bytes = torch.empty(blocks, dtype=torch.int64, device=dev)
    _size_kernel[(blocks,)](flat, lengths, block_bytes, n, width, BLOCK=block, num_warps=_WARPS)
    ends = block_bytes.cumsum(0)
    out = torch.empty(2 + n * (chars.shape[1] + 3), dtype=torch.uint8, device=dev)
    length = torch.empty(1, dtype=torch.int64, device=dev)
    _write_kernel[(blocks,)](
        flat,
        lengths,
        chars,
        ends,
        out,
        length,
        n,
        width,
        blocks,
        BLOCK=block,
        CHARS=chars.shape[1],
        num_warps=_WARPS,
    )
    return out, length
