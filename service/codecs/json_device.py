"""JSON rows of numbers read and written by the GPU: a /v1 forward's JSON body parsed where its
numbers go, and its 16-bit output printed there.

A DeepSeek-V3-sized JSON forward (64 tokens, megabytes of text each way) costs tens of ms in
orjson on one host core, half a million Python floats each way (`service/codecs/json_numbers.py`;
`bench/json_bench.py` times both paths).
Here the body's bytes go to the device as they are: three Triton kernels read every number and
check the layout (`service/codecs/json_device_kernel.py`; `parse_rows` does the same with torch
ops on the CPU, their reference); the output's text comes from a table of the 65,536 values a
16-bit dtype has, written by the same orjson call the host path makes, and two Triton kernels
print the rows with it (`service/codecs/json_print_kernel.py`; `rows_text`: torch ops, their
reference).

Both paths give the same result, and the host path stays the one that explains: anything these
ops do not accept (another layout of the body, a token that is not a JSON number, ragged or empty
rows, a number with more than 18 significant digits, an exponent beyond 10^±44 or a value beyond
float32's range) returns None and the caller decodes on the host, which names the problem.
Numbers are read as the host path reads them, to the nearest float64 and then to float32: exactly
so (Clinger's fast path) for up to 15 significant digits and a power of ten within 10^±22, which
covers every float32 or bfloat16 printed in its shortest form; longer or larger ones take one
more float64 rounding, which can move the float32 only for a number within 2^-29 of a float32
rounding boundary.

The reading runs on the caller's thread, on the codec's own CUDA stream, and the host waits for
the device once, for the kernels' verdict (read or not, and the shape): the result is complete on
the device when it returns. On the CPU the torch ops run the tests, and the kernels run in
Triton's interpreter against them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import lru_cache

import torch

from . import json_tensors
from .json_limits import LIMITS
from .safetensors_wire import byte_view

log = logging.getLogger(__name__)
# byte classes; the number characters are contiguous (DIGIT..EXP)
OTHER, SPACE, OPEN, CLOSE, COMMA, DIGIT, MINUS, PLUS, DOT, EXP = range(10)
_CLASSES = {
    SPACE: b" \t\n\r",
    OPEN: b"[",
    CLOSE: b"]",
    COMMA: b",",
    DIGIT: b"0123456789",
    MINUS: b"-",
    PLUS: b"+",
    DOT: b".",
    EXP: b"eE",
}
# event kinds of the array's structure (a number counts at its first character)
_NONE, _NUMBER, _OPEN, _CLOSE, _COMMA = range(5)
_WS = rb"[ \t\n\r]*"
_ROUTING = rb'"return_routing"' + _WS + rb":" + _WS + rb"(true|false)"
# a /v1 forward body: hidden_states and at most return_routing, before or after it
_HEAD = re.compile(
    _WS + rb"\{" + _WS + rb"(?:" + _ROUTING + _WS + rb"," + _WS + rb")?"
    rb'"hidden_states"' + _WS + rb":" + _WS
)
_TAIL = re.compile(rb"\]" + _WS + rb"(?:," + _WS + _ROUTING + _WS + rb")?\}" + _WS + rb"\Z")
_TAIL_BYTES = 64


# JSON work on more than this many bytes of text is done on a GPU: the device's launches, copies
# and one wait cost about the same whatever the size, and from a DeepSeek-V3 row on (85 KB of
# text, a 70 KB reply) the device reads faster than orjson and prints about as fast; chosen by
# `bench/json_bench.py`.
DEVICE_FROM_BYTES = 64 << 10


def worth_it(nbytes: int) -> bool:
    """Whether JSON work on about `nbytes` of text is done on a GPU."""
    return nbytes > DEVICE_FROM_BYTES


@dataclass(frozen=True)
class DeviceForward:
    """A /v1 forward's JSON body, parsed on the device."""

    hidden_states: torch.Tensor  # [T, H] float32, on the device
    return_routing: bool


def forward_span(body: bytes | bytearray | memoryview) -> tuple[slice, bool] | None:
    """Where hidden_states' array lies in a /v1 forward body holding only it and, before or after
    it, return_routing; and return_routing. None for any other body."""
    head = _HEAD.match(body)
    if head is None:
        return None
    tail_from = max(head.end(), len(body) - _TAIL_BYTES)
    tail = _TAIL.search(body, tail_from)
    if tail is None or (head.group(1) and tail.group(1)):  # return_routing twice
        return None
    routing = (head.group(1) or tail.group(1) or b"false") == b"true"
    return slice(head.end(), tail.start() + 1), routing


def decode_forward(
    body: bytes | bytearray | memoryview, device: torch.device
) -> DeviceForward | None:
    """A /v1 forward's JSON body -> hidden_states on `device`, copied there from where it lies
    (by DMA from pinned or registered memory); None where the host path must decode it (see the
    module's docstring), or the device has no memory left for the ops' temporaries."""
    span = forward_span(body)
    if span is None:
        return None
    where, routing = span
    text = byte_view(memoryview(body)[where])
    try:
        with _on_stream(device):
            rows = parse_rows(text.to(device))
    except torch.OutOfMemoryError:
        log.warning("no device memory to read a %d-byte JSON body: read on the host", len(body))
        return None
    return None if rows is None else DeviceForward(rows, routing)


def warm_up(device: torch.device, dtypes: Iterable[torch.dtype]) -> None:
    """Compile the reading kernels and build the print tables of the 16-bit `dtypes` on
    `device` at start-up, so that the first large JSON request does not pay for them (a Triton
    compile takes seconds, longer on a loaded host). On the CPU the torch ops run (tests)."""
    parsed = decode_forward(b'{"hidden_states": [[1.5, -25e-2], [0, 12.25E+1]]}', device)
    if parsed is None or parsed.hidden_states.tolist() != [[1.5, -0.25], [0.0, 122.5]]:
        raise RuntimeError(f"reading JSON on {device} gave {parsed}: the device path is broken")
    for dtype in {d for d in dtypes if d.itemsize == 2}:
        with _on_stream(device):
            print_rows(torch.zeros(1, 2, dtype=dtype, device=device))


def print_rows(values: torch.Tensor) -> memoryview:
    """[T, W] of a 16-bit float dtype, on any device -> the JSON text `[[..], ..]` the host path
    writes for it (`json_tensors.dumps`: orjson, each value in its shortest form), in host
    memory."""
    return _to_host(_rows_text(values))


def _to_host(text: torch.Tensor) -> memoryview:
    # Pageable: a pinned block from torch's cache per reply often came as a new page-locked
    # allocation of milliseconds. The service prints a large reply into pinned memory of its
    # own instead (`print_reply_into`).
    return memoryview(text.cpu().numpy())


def _rows_text(values: torch.Tensor) -> torch.Tensor:
    """`print_rows`'s text, uint8 on the values' device: on a GPU written by Triton kernels
    (`service/codecs/json_print_kernel.py`), elsewhere by `rows_text`, their reference."""
    chars, lengths = _number_table(values.dtype, values.device)
    if not values.is_cuda:
        return rows_text(values, chars, lengths)
    from .json_print_kernel import write_rows  # Triton: GPUs only

    text, length = write_rows(values, chars, lengths)
    return text[: int(length)]  # the host waits once, for the length


def rows_text(values: torch.Tensor, chars: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[T, W] of a 16-bit dtype and its table -> the rows' JSON text, uint8, with torch ops.

    Each value's text comes from the table; each lands at the offset the lengths before it sum
    to, with the row's brackets and the commas between."""
    rows, width = values.shape
    dev = values.device
    index = values.reshape(-1).view(torch.int16).int() & 0xFFFF
    n = index.numel()
    length = lengths[index]
    column = torch.arange(n, device=dev) % width
    # "[" before a row; "," or "]" after a number; "," or "]" after a row
    size = length + 1 + (column == 0) + (column == width - 1)
    end = 1 + size.cumsum(0)
    first = end - size + (column == 0)  # a number's first byte
    out = torch.empty(2 + n * (chars.shape[1] + 3), dtype=torch.uint8, device=dev)
    spare = out.numel() - 1  # where the table's padding goes
    at = first[:, None] + torch.arange(chars.shape[1], device=dev)
    out[torch.where(at < (first + length)[:, None], at, spare)] = chars[index]
    ends = (first + length).view(rows, width)
    out[0] = ord("[")
    out[(end - size).view(rows, width)[:, 0]] = ord("[")
    out[ends.reshape(-1)] = ord(",")
    out[ends[:, -1]] = ord("]")
    between = torch.full((rows,), ord(","), dtype=torch.uint8, device=dev)
    between[-1] = ord("]")
    out[ends[:, -1] + 1] = between
    return out[: int(end[-1])]


_REPLY_OPEN = b'{"output":'  # a reply up to its rows


def print_reply(output: torch.Tensor, rest: dict) -> list[bytes | memoryview]:
    """The JSON object {"output": output, **rest} as `json_tensors.dumps` writes it, in pieces
    (the rows' text stays in the host memory it was copied to), `output` (16-bit, on the
    device) printed by `print_rows` (by orjson when the device has no memory left for it)."""
    try:
        with _on_stream(output.device):
            rows = print_rows(output)
    except torch.OutOfMemoryError:
        log.warning("no device memory to print a %s output: printed on the host", output.shape)
        return [json_tensors.dumps({"output": output} | rest)]
    return [_REPLY_OPEN, rows, _close(rest)]


def print_reply_into(
    output: torch.Tensor, rest: dict, into: memoryview
) -> int | list[bytes | memoryview]:
    """`print_reply`'s reply written into `into`, the rows' text copied from the device straight
    there (by DMA, into memory registered with CUDA); its size. Where it is longer than `into`
    (or printed on the host, the device's memory full), nothing is written and its pieces are
    returned instead."""
    close = _close(rest)
    try:
        with _on_stream(output.device):
            text = _rows_text(output)
            size = len(_REPLY_OPEN) + text.numel() + len(close)
            if size > len(into):
                return [_REPLY_OPEN, _to_host(text), close]
            rows = torch.frombuffer(
                into, dtype=torch.uint8, count=text.numel(), offset=len(_REPLY_OPEN)
            )
            rows.copy_(text)
    except torch.OutOfMemoryError:
        log.warning("no device memory to print a %s output: printed on the host", output.shape)
        return [json_tensors.dumps({"output": output} | rest)]
    into[: len(_REPLY_OPEN)] = _REPLY_OPEN
    into[size - len(close) : size] = close
    return size


def _close(rest: dict) -> bytes:
    """What follows the rows in a reply: `rest`'s members and the closing brace."""
    return b"," + json_tensors.dumps(rest)[1:]


@lru_cache(maxsize=8)
def _number_table(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of the 65,536 values of a 16-bit dtype as `json_tensors.dumps` writes it: uint8 text
    [65536, the longest's length rounded up to a power of two] (zero padded) and int32 lengths,
    indexed by the value's bits."""
    bits = torch.arange(1 << 16, dtype=torch.int32)
    values = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(dtype)
    texts = json_tensors.dumps(values)[1:-1].split(b",")
    room = 1 << (max(map(len, texts)) - 1).bit_length()
    chars = torch.zeros(len(texts), room, dtype=torch.uint8)
    padded = b"".join(t.ljust(room, b"\0") for t in texts)
    chars.copy_(torch.frombuffer(bytearray(padded), dtype=torch.uint8).view(len(texts), room))
    lengths = torch.tensor([len(t) for t in texts], dtype=torch.int32)
    return chars.to(device), lengths.to(device)


def parse_rows(text: torch.Tensor) -> torch.Tensor | None:
    """uint8 text of a JSON array of rows of numbers, `[[1, -2.5e3], [0, 4]]`, on any device ->
    float32 [rows, columns] there; None where it is not one (any other byte or layout, a token
    that is not a JSON number, ragged or empty rows) or holds a number beyond LIMITS.

    On a GPU, Triton kernels read it all (`service/codecs/json_device_kernel.py`) and the host
    waits once, for their verdict; elsewhere torch ops do: `read_numbers`, the kernels'
    reference for the numbers, and a check of each event against the nesting depth, theirs for
    the layout."""
    if text.numel() == 0:
        return None
    if text.is_cuda:
        from .json_device_kernel import read_rows  # Triton: GPUs only

        return _shaped(*read_rows(text, LIMITS))
    dev = text.device
    c = _class_table(dev)[text.int()]
    number = (c >= DIGIT) & (c <= EXP)
    starts = number & ~_before(number, False)
    first = starts.nonzero().squeeze(1)  # each number's first byte
    if first.numel() == 0:
        return None
    read = read_numbers(text, c, starts, first)
    if read is None:
        return None
    numbers, rejected = read

    # the structure, [[n, ...], ...]: each event (a bracket, a comma, a number's first byte)
    # checked against the event before it and the nesting depth after it
    opened = (c == OPEN).cumsum(0, dtype=torch.int32)
    depth = opened - (c == CLOSE).cumsum(0, dtype=torch.int32)
    kind = torch.where(starts, _NUMBER, _event_kinds(dev)[c.int()])
    events = (kind != _NONE).nonzero().squeeze(1)
    kind, depth = kind[events], depth[events]
    previous = _before(kind, _NONE)
    is_last = torch.arange(len(kind), device=dev) == len(kind) - 1
    after_open_or_comma = (previous == _OPEN) | (previous == _COMMA)
    allowed = torch.where(
        kind == _NUMBER,
        (depth == 2) & after_open_or_comma,
        torch.where(
            kind == _COMMA,
            ((depth == 2) & (previous == _NUMBER)) | ((depth == 1) & (previous == _CLOSE)),
            torch.where(
                kind == _OPEN,
                ((previous == _NONE) & (depth == 1)) | ((depth == 2) & after_open_or_comma),
                ((depth == 1) & (previous == _NUMBER))
                | ((depth == 0) & (previous == _CLOSE) & is_last),
            ),
        ),
    )
    # rows of one width: the numbers before the r-th row's end are r times the first row's
    row_end = (kind == _CLOSE) & (depth == 1)
    numbers_so_far = (kind == _NUMBER).cumsum(0)
    width = numbers_so_far[row_end.int().argmax()]
    ragged = (row_end & (numbers_so_far != row_end.cumsum(0) * width)).any()
    closed = (kind[-1] == _CLOSE) & (depth[-1] == 0)
    failed = rejected | (c == OTHER).any() | ~allowed.all() | ragged | ~closed
    return _shaped(numbers, torch.stack([failed.long(), row_end.sum(), width]))


def _shaped(numbers: torch.Tensor, verdict: torch.Tensor) -> torch.Tensor | None:
    """The numbers read, in order of the text, as [rows, width]; None where the verdict,
    [failed, rows, width] (copied to the host: the one wait for the device), says so."""
    failed, rows, width = verdict.tolist()
    return None if failed else numbers[: rows * width].view(rows, width)


def read_numbers(
    text: torch.Tensor, c: torch.Tensor, starts: torch.Tensor, first: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The numbers of `text` (byte classes `c`; `starts`: the bytes that start one, at `first`)
    -> (float32 [numbers], whether one is not JSON or beyond LIMITS), or None for a number of
    more than LIMITS.token_bytes. Torch ops over every byte at once."""
    dev = text.device
    number = (c >= DIGIT) & (c <= EXP)
    digit, minus, plus, dot, exp = (c == k for k in (DIGIT, MINUS, PLUS, DOT, EXP))
    before, after = _before(c, SPACE), _after(c, SPACE)
    last = (number & ~_after(number, False)).nonzero().squeeze(1)  # each number's last byte
    token = (starts.cumsum(0, dtype=torch.int32) - 1).clamp(min=0)  # a number byte's token
    start_of = first[token]

    def so_far(mask: torch.Tensor) -> torch.Tensor:
        """How many bytes of `mask` each byte's token holds up to it, it included."""
        inclusive = mask.cumsum(0, dtype=torch.int32)
        return inclusive - (inclusive - mask.int())[start_of]

    def per_token(mask: torch.Tensor) -> torch.Tensor:
        """How many bytes of `mask` each token holds."""
        inclusive = mask.cumsum(0, dtype=torch.int32)
        return inclusive[last] - inclusive[first] + mask[first].int()

    # JSON's number grammar, -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, byte by byte
    exps, dots = so_far(exp), so_far(dot)
    signed_exponent = (after == DIGIT) | (after == MINUS) | (after == PLUS)
    integer_start = digit & (starts | (_before(starts, False) & (before == MINUS)))
    bad = (
        (minus & ~((after == DIGIT) & (starts | (before == EXP))))
        | (plus & ~((after == DIGIT) & (before == EXP)))
        | (dot & ~((before == DIGIT) & (after == DIGIT) & (exps == 0) & (dots == 1)))
        | (exp & ~((before == DIGIT) & signed_exponent & (exps == 1)))
        | (integer_start & (text == ord("0")) & (after == DIGIT))
    ).any()
    # each digit times 10 to the count of its part's digits after it in its token
    mantissa, exponent = digit & (exps == 0), digit & (exps > 0)
    mantissa_left = per_token(mantissa)[token] - so_far(mantissa)
    exponent_left = per_token(exponent)[token] - so_far(exponent)
    significant = mantissa & (so_far(mantissa & (text != ord("0"))) > 0)
    pow10 = _powers_of_ten(dev)
    value = (text - ord("0")).long()
    longest = int((last - first).max()) + 1
    if longest > LIMITS.token_bytes:
        return None
    # a token's sums over the bytes it spans (int64: a sum over all bytes could overflow)
    span = first[:, None] + torch.arange(longest, device=dev)
    inside = span <= last[:, None]
    span = span.clamp(max=text.numel() - 1)

    def token_sum(part: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        terms = value * pow10[left.clamp(0, LIMITS.significant_digits)] * part
        return (terms[span] * inside).sum(1)

    m = token_sum(mantissa, mantissa_left)
    e = token_sum(exponent, exponent_left)
    e = torch.where(per_token(minus & (before == EXP)) > 0, -e, e)
    power = e - per_token(mantissa & (dots > 0))  # less the fraction's digits
    numbers = _scaled(m.double(), power)
    # "-0" is an integer (0, as orjson reads it); "-0.0" a float (-0.0)
    negative = (per_token(minus & starts) > 0) & ((m != 0) | (per_token(dot | exp) > 0))
    numbers = torch.where(negative, -numbers, numbers)
    beyond = (
        (significant & (mantissa_left >= LIMITS.significant_digits)).any()
        | (exponent & (exponent_left >= LIMITS.exponent_digits)).any()
        | (power.abs() > 2 * LIMITS.exact_power).any()
    )
    floats = numbers.float()
    return floats, bad | beyond | floats.isinf().any()  # beyond float32: an infinity


def _scaled(m: torch.Tensor, power: torch.Tensor) -> torch.Tensor:
    """m * 10^power in float64: one correctly rounded operation for |power| <= 22 (m exact, as
    it is below 2^53), two beyond."""
    exact = _exact_powers_of_ten(m.device)
    near = power.clamp(-LIMITS.exact_power, LIMITS.exact_power)
    far = (power - near).clamp(-LIMITS.exact_power, LIMITS.exact_power)
    out = torch.where(near >= 0, m * exact[near.abs()], m / exact[near.abs()])
    return torch.where(far >= 0, out * exact[far.abs()], out / exact[far.abs()])


def _on_stream(device: torch.device) -> AbstractContextManager:
    """The codec's own CUDA stream on a GPU (its work does not queue behind the layer's)."""
    return torch.cuda.stream(_stream(device)) if device.type == "cuda" else nullcontext()


@lru_cache(maxsize=8)
def _stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _before(x: torch.Tensor, fill: int | bool) -> torch.Tensor:
    """x[i - 1] at i; `fill` at 0."""
    return torch.cat([x.new_full((1,), fill), x[:-1]])


def _after(x: torch.Tensor, fill: int | bool) -> torch.Tensor:
    """x[i + 1] at i; `fill` at the end."""
    return torch.cat([x[1:], x.new_full((1,), fill)])


@lru_cache(maxsize=8)
def _class_table(device: torch.device) -> torch.Tensor:
    table = torch.full((256,), OTHER, dtype=torch.uint8)
    for k, members in _CLASSES.items():
        table[list(members)] = k
    return table.to(device)


@lru_cache(maxsize=8)
def _event_kinds(device: torch.device) -> torch.Tensor:
    """Byte class -> event kind (numbers are found by their first byte instead)."""
    kinds = torch.full((EXP + 1,), _NONE, dtype=torch.uint8)
    kinds[[OPEN, CLOSE, COMMA]] = torch.tensor([_OPEN, _CLOSE, _COMMA], dtype=torch.uint8)
    return kinds.to(device)


@lru_cache(maxsize=8)
def _powers_of_ten(device: torch.device) -> torch.Tensor:
    """10^0 .. 10^LIMITS.significant_digits, int64."""
    return torch.tensor([10**k for k in range(LIMITS.significant_digits + 1)]).to(device)


@lru_cache(maxsize=8)
def _exact_powers_of_ten(device: torch.device) -> torch.Tensor:
    """10^0 .. 10^22, float64 (each exact)."""
    powers = [10.0**k for k in range(LIMITS.exact_power + 1)]
    return torch.tensor(powers, dtype=torch.float64).to(device)
