"""A JSON array of rows of numbers, `[[1.5, -2e3], [0, 4]]`, read on a GPU by three Triton
kernels and one torch op, with one copy to the host: the verdict. The text is cut into blocks
of BLOCK_BYTES, and

1. `_count_kernel` finds each block's events (O `[`, C `]`, M `,`, N a number's first byte)
   and counts its numbers, its events and its `]`s;
2. their cumulative sums over the blocks (torch) give each block the index of its first number,
   event and `]` in the whole text;
3. `_place_kernel` writes each number's first byte and each event at that index, and checks
   that the rows hold as many numbers each;
4. `_read_kernel` reads each number (a state machine runs JSON's number grammar from its first
   byte, as `json_device.read_numbers` does with torch ops, on the CPU and as its reference)
   and checks each event against the two before it.

The events must spell `O O N (M N)* C (M O N (M N)* C)* C` (whitespace between them, no other
byte): a language decided by its windows of three, so each event is checked where it lies,
with no pass over the whole text. Every kernel adds what it refuses to one verdict, [failed,
rows, width]; the launches, the sum and the host's read of the verdict queue on one stream, so
the host waits once. The kernels are compiled once for every text (no specialisation on its
size), at warm-up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .json_limits import NumberLimits
from .json_numbers import FLOAT32_MAX as _FLOAT32_MAX

# bytes a program of each kernel takes: each reads a block's bytes, or as many events and half
# as many numbers (a text holds no more events than bytes, no more numbers than half its bytes,
# rounded up), so all three launch one program a block
BLOCK_BYTES = 4096
_WARPS = 8  # 16 bytes, 8 numbers a thread: no spills
# event kinds; NONE also stands before the first event and after the last
NONE = tl.constexpr(0)
OPEN = tl.constexpr(1)  # "["
CLOSE = tl.constexpr(2)  # "]"
COMMA = tl.constexpr(3)  # ","
NUMBER = tl.constexpr(4)  # a number's first byte
# the verdict's fields
FAILED = tl.constexpr(0)
ROWS = tl.constexpr(1)
WIDTH = tl.constexpr(2)
# a NaN's bits: Triton refuses a NaN global constant (NaN != NaN reads as "changed since the
# kernel was compiled" at every launch after the first)
NAN_BITS = tl.constexpr(0x7FC00000)
FLOAT32_MAX = tl.constexpr(_FLOAT32_MAX)  # a number read beyond it is the host's to name
# states of a number's reading, in the order the grammar meets them
BEGIN = tl.constexpr(0)
SIGN = tl.constexpr(1)  # "-"
ZERO = tl.constexpr(2)  # "-0": no digit may follow
INTEGER = tl.constexpr(3)
DOT = tl.constexpr(4)
FRACTION = tl.constexpr(5)
E = tl.constexpr(6)
E_SIGN = tl.constexpr(7)
EXPONENT = tl.constexpr(8)
DONE = tl.constexpr(9)  # read: it ended where it may
BAD = tl.constexpr(10)  # not a JSON number
# bytes
ZERO_CHAR = tl.constexpr(48)
NINE_CHAR = tl.constexpr(57)
MINUS_CHAR = tl.constexpr(45)
PLUS_CHAR = tl.constexpr(43)
DOT_CHAR = tl.constexpr(46)


@triton.jit
def _is_exp(ch):
    return (ch == 101) | (ch == 69)  # e E


@triton.jit
def _in_number(ch):
    """Whether a byte may be part of a number: a digit, a sign, a dot or an exponent's e."""
    digit = (ch >= ZERO_CHAR) & (ch <= NINE_CHAR)
    return digit | (ch == MINUS_CHAR) | (ch == PLUS_CHAR) | (ch == DOT_CHAR) | _is_exp(ch)


@triton.jit
def _block_events(text_ptr, n, BLOCK: tl.constexpr):
    """This program's block of the text: each byte's position, its event kind (NONE: not an
    event), and whether no array of rows holds it (not an event, a number's or whitespace)."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    ch = tl.load(text_ptr + at, mask=inside, other=32).to(tl.int32)
    before = tl.load(text_ptr + at - 1, mask=inside & (at > 0), other=32).to(tl.int32)
    number = _in_number(ch)
    kind = tl.where(
        number & ~_in_number(before),
        NUMBER,
        tl.where(ch == 91, OPEN, tl.where(ch == 93, CLOSE, tl.where(ch == 44, COMMA, NONE))),
    )
    space = (ch == 32) | (ch == 9) | (ch == 10) | (ch == 13)
    other = inside & ~number & ~space & (kind == NONE)
    return at, kind, other


@triton.jit(do_not_specialize=["n"])
def _count_kernel(text_ptr, counts_ptr, verdict_ptr, n, BLOCK: tl.constexpr):
    """counts[block] = its numbers, events and `]`s; the verdict zeroed (by the first program:
    the later launches add to it)."""
    _, kind, _ = _block_events(text_ptr, n, BLOCK)
    row = counts_ptr + tl.program_id(0) * 3
    tl.store(row, tl.sum((kind == NUMBER).to(tl.int32)))
    tl.store(row + 1, tl.sum((kind != NONE).to(tl.int32)))
    tl.store(row + 2, tl.sum((kind == CLOSE).to(tl.int32)))
    field = tl.arange(0, 4)
    tl.store(verdict_ptr + field, 0, mask=field < tl.where(tl.program_id(0) == 0, 3, 0))


@triton.jit(do_not_specialize=["n", "blocks"])
def _place_kernel(
    text_ptr, sums_ptr, first_ptr, events_ptr, verdict_ptr, n, blocks, BLOCK: tl.constexpr
):
    """Each number's first byte and each event written at its index in the text (`sums`: the
    counts' cumulative sums); the shape into the verdict, and a failure where a byte belongs to
    no array of rows, the rows' widths differ or the text holds no number."""
    block = tl.program_id(0)
    at, kind, other = _block_events(text_ptr, n, BLOCK)
    number, event, close = kind == NUMBER, kind != NONE, kind == CLOSE
    before = sums_ptr + (block - 1) * 3  # what the blocks before this one hold
    numbers_before = tl.load(before, mask=block > 0, other=0)
    events_before = tl.load(before + 1, mask=block > 0, other=0)
    closes_before = tl.load(before + 2, mask=block > 0, other=0)
    totals = sums_ptr + (blocks - 1) * 3
    numbers, closes = tl.load(totals), tl.load(totals + 2)
    numbers_so_far = numbers_before + tl.cumsum(number.to(tl.int32), axis=0)
    tl.store(first_ptr + numbers_so_far - 1, at, mask=number)
    events_so_far = events_before + tl.cumsum(event.to(tl.int32), axis=0)
    tl.store(events_ptr + events_so_far - 1, kind.to(tl.int8), mask=event)
    # in an array of rows each `]` but the last ends a row; where each of the r-th row's end is
    # preceded by r times `width` numbers, every row holds `width` (the last one: all of them)
    rows = closes - 1
    width = numbers // tl.maximum(rows, 1)
    closes_so_far = closes_before + tl.cumsum(close.to(tl.int32), axis=0)
    row_end = close & (closes_so_far < closes)
    ragged = row_end & (numbers_so_far.to(tl.int64) != closes_so_far.to(tl.int64) * width)
    failed = tl.max((other | ragged).to(tl.int32), axis=0) | (numbers == 0).to(tl.int32)
    tl.atomic_max(verdict_ptr + FAILED, failed)
    tl.store(verdict_ptr + ROWS, rows, mask=block == 0)
    tl.store(verdict_ptr + WIDTH, width, mask=block == 0)


@triton.jit
def _allowed(a, b, c):
    """Whether the events a, b, c may follow each other in `O O N (M N)* C (M O N (M N)* C)* C`
    (NONE: before the first event, after the last)."""
    after_open_or_comma = (a == OPEN) | (a == COMMA)
    return (
        ((a == NONE) & (b == NONE) & (c == OPEN))  # the array opens
        | ((a == NONE) & (b == OPEN) & (c == OPEN))  # its first row opens
        | (after_open_or_comma & (b == OPEN) & (c == NUMBER))  # a row's first number
        | (after_open_or_comma & (b == NUMBER) & ((c == COMMA) | (c == CLOSE)))  # more, or the end
        | ((a == NUMBER) & (b == COMMA) & (c == NUMBER))  # the row's next number
        | ((a == NUMBER) & (b == CLOSE) & ((c == COMMA) | (c == CLOSE)))  # a row, or the end
        | ((a == CLOSE) & (b == COMMA) & (c == OPEN))  # the next row opens
        | ((a == CLOSE) & (b == CLOSE) & (c == NONE))  # nothing after the array
    )


@triton.jit
def _scale(x, power, MAX_POWER: tl.constexpr):
    """x * 10^power (|power| <= MAX_POWER, whose powers of ten float64 holds exactly): one
    correctly rounded operation (float64 division is IEEE's; div_rn is float32's only)."""
    p = tl.full(x.shape, 1.0, tl.float64)
    for j in tl.static_range(MAX_POWER):
        p = tl.where(j < tl.abs(power), p * 10.0, p)
    return tl.where(power >= 0, x * p, x / p)


@triton.jit
def _read_number(
    text_ptr,
    offs,
    inside,
    n,
    MAX_BYTES: tl.constexpr,
    MAX_SIGNIFICANT: tl.constexpr,
    MAX_EXP_DIGITS: tl.constexpr,
    MAX_POWER: tl.constexpr,
):
    """The numbers whose first bytes are at `offs` (where `inside`) -> their float32 values and
    whether each was read (False: not JSON, beyond the limits or beyond float32's range: the
    host must read it)."""
    state = tl.where(inside, BEGIN, DONE)  # DONE: nothing to read
    m = tl.zeros(offs.shape, tl.int64)
    significant = tl.zeros(offs.shape, tl.int32)
    fraction = tl.zeros(offs.shape, tl.int32)
    exponent = tl.zeros(offs.shape, tl.int32)
    exponent_digits = tl.zeros(offs.shape, tl.int32)
    negative = tl.zeros(offs.shape, tl.int1)
    negative_exponent = tl.zeros(offs.shape, tl.int1)
    is_float = tl.zeros(offs.shape, tl.int1)
    # a byte a step, up to MAX_BYTES + 1 of them, while a number is still being read
    k = tl.zeros((), tl.int32)
    while (k <= MAX_BYTES) & (tl.max((state < DONE).to(tl.int32), axis=0) > 0):
        reading = state < DONE
        at = offs + k
        c = tl.load(text_ptr + at, mask=reading & (at < n), other=32).to(tl.int32)
        digit = (c >= ZERO_CHAR) & (c <= NINE_CHAR)
        d = (c - ZERO_CHAR).to(tl.int64)
        in_mantissa = reading & digit & (state <= FRACTION)
        significant += (in_mantissa & ((m != 0) | (d != 0))).to(tl.int32)
        m = tl.where(in_mantissa, m * 10 + d, m)
        fraction += (in_mantissa & (state >= DOT)).to(tl.int32)
        in_exponent = reading & digit & (state >= E)
        exponent = tl.where(in_exponent, exponent * 10 + (c - ZERO_CHAR), exponent)
        exponent_digits += in_exponent.to(tl.int32)
        negative = negative | (reading & (c == MINUS_CHAR) & (state == BEGIN))
        negative_exponent = negative_exponent | (reading & (c == MINUS_CHAR) & (state == E))
        is_float = is_float | (reading & ((c == DOT_CHAR) | _is_exp(c)))
        integer = (state == ZERO) | (state == INTEGER)
        after_digit = tl.where(
            state <= SIGN,
            tl.where(c == ZERO_CHAR, ZERO, INTEGER),
            tl.where(
                state == ZERO,
                BAD,
                tl.where(
                    state == INTEGER, INTEGER, tl.where(state <= FRACTION, FRACTION, EXPONENT)
                ),
            ),
        )
        after_sign = tl.where(
            state == E, E_SIGN, tl.where((c == MINUS_CHAR) & (state == BEGIN), SIGN, BAD)
        )
        after_dot = tl.where(integer, DOT, BAD)
        after_e = tl.where(integer | (state == FRACTION), E, BAD)
        ended = tl.where(integer | (state == FRACTION) | (state == EXPONENT), DONE, BAD)
        sign = (c == MINUS_CHAR) | (c == PLUS_CHAR)
        after = tl.where(
            digit,
            after_digit,
            tl.where(
                sign,
                after_sign,
                tl.where(c == DOT_CHAR, after_dot, tl.where(_is_exp(c), after_e, ended)),
            ),
        )
        state = tl.where(reading, after, state)
        k += 1
    power = tl.where(negative_exponent, -exponent, exponent) - fraction
    too_much = (
        (state < DONE)  # longer than MAX_BYTES
        | (significant > MAX_SIGNIFICANT)
        | (exponent_digits > MAX_EXP_DIGITS)
        | (tl.abs(power) > 2 * MAX_POWER)
    )
    near = tl.minimum(tl.maximum(power, -MAX_POWER), MAX_POWER)
    far = tl.minimum(tl.maximum(power - near, -MAX_POWER), MAX_POWER)
    value = _scale(_scale(m.to(tl.float64), near, MAX_POWER), far, MAX_POWER)
    # "-0" is an integer (0, as orjson reads it); "-0.0" a float (-0.0: times -1, as Triton's
    # unary minus is 0 - x, +0.0 for a zero)
    value = tl.where(negative & ((m != 0) | is_float), value * -1.0, value).to(tl.float32)
    return value, (state == DONE) & ~too_much & (tl.abs(value) <= FLOAT32_MAX)


@triton.jit(do_not_specialize=["n", "blocks"])
def _read_kernel(
    text_ptr,
    sums_ptr,
    first_ptr,
    events_ptr,
    value_ptr,
    verdict_ptr,
    n,
    blocks,
    MAX_BYTES: tl.constexpr,
    MAX_SIGNIFICANT: tl.constexpr,
    MAX_EXP_DIGITS: tl.constexpr,
    MAX_POWER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """BLOCK events checked against the two before each, BLOCK / 2 numbers read (NaN where the
    host must read one); a failure into the verdict where either refuses."""
    program = tl.program_id(0)
    totals = sums_ptr + (blocks - 1) * 3
    numbers, events = tl.load(totals), tl.load(totals + 1)
    failed = tl.zeros((), tl.int32)
    if program * BLOCK < events:
        at = program * BLOCK + tl.arange(0, BLOCK)
        inside = at < events
        kind = tl.load(events_ptr + at, mask=inside, other=NONE).to(tl.int32)
        one = tl.load(events_ptr + at - 1, mask=inside & (at >= 1), other=NONE).to(tl.int32)
        two = tl.load(events_ptr + at - 2, mask=inside & (at >= 2), other=NONE).to(tl.int32)
        refused = ~_allowed(two, one, kind) | ((at == events - 1) & ~_allowed(one, kind, NONE))
        failed |= tl.max((inside & refused).to(tl.int32), axis=0)
    if program * (BLOCK // 2) < numbers:
        token = program * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
        inside = token < numbers
        offs = tl.load(first_ptr + token, mask=inside, other=0)
        value, read = _read_number(
            text_ptr, offs, inside, n, MAX_BYTES, MAX_SIGNIFICANT, MAX_EXP_DIGITS, MAX_POWER
        )
        nan = tl.full(value.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        tl.store(value_ptr + token, tl.where(read, value, nan), mask=inside)
        failed |= tl.max((inside & ~read).to(tl.int32), axis=0)
    tl.atomic_max(verdict_ptr + FAILED, failed)


def read_rows(
    text: torch.Tensor, limits: NumberLimits, block: int = BLOCK_BYTES
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 text (not empty, under 2 GiB), on a GPU or in Triton's interpreter -> float32
    [(bytes + 1) // 2]: its numbers in order of the text, each NaN where the host must read it;
    and int32 [3], the verdict: FAILED (1: not an array of rows of numbers within `limits`),
    ROWS and WIDTH. Both stay on the text's device, written once the launches run. `block`: a
    power of two, the bytes of a program."""
    dev, n = text.device, text.numel()
    blocks = triton.cdiv(n, block)
    counts = torch.empty(blocks, 3, dtype=torch.int32, device=dev)
    verdict = torch.empty(3, dtype=torch.int32, device=dev)
    _count_kernel[(blocks,)](text, counts, verdict, n, BLOCK=block, num_warps=_WARPS)
    sums = counts.cumsum(0, dtype=torch.int32)
    first = torch.empty((n + 1) // 2, dtype=torch.int32, device=dev)
    events = torch.empty(n, dtype=torch.int8, device=dev)
    _place_kernel[(blocks,)](
        text, sums, first, events, verdict, n, blocks, BLOCK=block, num_warps=_WARPS
    )
    values = torch.empty((n + 1) // 2, dtype=torch.float32, device=dev)
    _read_kernel[(blocks,)](
        text,
        sums,
        first,
        events,
        values,
        verdict,
        n,
        blocks,
        MAX_BYTES=limits.token_bytes,
        MAX_SIGNIFICANT=limits.significant_digits,
        MAX_EXP_DIGITS=limits.exponent_digits,
        MAX_POWER=limits.exact_power,
        BLOCK=block,
        num_warps=_WARPS,
    )
    return values, verdict
