"""The numbers of a JSON text read by one Triton kernel: for each number (its first byte found
by the caller) a small state machine runs JSON's number grammar over the bytes that follow and
computes the value, as `json_device.read_numbers` does with about a hundred torch ops (that
version runs on the CPU and is this one's reference; their launches were most of a body's
time on a GPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .json_limits import NumberLimits

_BLOCK = 1024
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
def _scale(x, power, MAX_POWER: tl.constexpr):
    """x * 10^power (|power| <= MAX_POWER, whose powers of ten float64 holds exactly): one
    correctly rounded operation (float64 division is IEEE's; div_rn is float32's only)."""
    p = tl.full(x.shape, 1.0, tl.float64)
    for j in tl.static_range(MAX_POWER):
        p = tl.where(j < tl.abs(power), p * 10.0, p)
    return tl.where(power >= 0, x * p, x / p)


@triton.jit(do_not_specialize=["numbers", "n"])  # one compile, at warm-up, for every body
def _read_numbers_kernel(
    text_ptr,
    first_ptr,
    value_ptr,
    status_ptr,
    numbers,
    n,
    MAX_BYTES: tl.constexpr,
    MAX_SIGNIFICANT: tl.constexpr,
    MAX_EXP_DIGITS: tl.constexpr,
    MAX_POWER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = token < numbers
    offs = tl.load(first_ptr + token, mask=inside, other=0)  # the number's first byte
    state = tl.where(inside, BEGIN, DONE)  # DONE: nothing to read
    m = tl.zeros((BLOCK,), tl.int64)
    significant = tl.zeros((BLOCK,), tl.int32)
    fraction = tl.zeros((BLOCK,), tl.int32)
    exponent = tl.zeros((BLOCK,), tl.int32)
    exponent_digits = tl.zeros((BLOCK,), tl.int32)
    negative = tl.zeros((BLOCK,), tl.int1)
    negative_exponent = tl.zeros((BLOCK,), tl.int1)
    is_float = tl.zeros((BLOCK,), tl.int1)
    for k in tl.static_range(MAX_BYTES + 1):
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
    value = tl.where(negative & ((m != 0) | is_float), value * -1.0, value)
    # 1: read; 2: the host must read it (not JSON, or beyond the above)
    status = tl.where((state == DONE) & ~too_much, 1, 2)
    tl.store(value_ptr + token, value.to(tl.float32), mask=inside)
    tl.store(status_ptr + token, status.to(tl.int8), mask=inside)


def read_numbers(
    text: torch.Tensor, first: torch.Tensor, limits: NumberLimits
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 text on a GPU and the first byte of each number in it (int64) -> float32 values
    and int8 statuses, one per number: 1 read, 2 the host must read it (not JSON, or beyond
    `limits`)."""
    count = first.numel()
    value = torch.empty(count, dtype=torch.float32, device=text.device)
    status = torch.empty(count, dtype=torch.int8, device=text.device)
    _read_numbers_kernel[(triton.cdiv(count, _BLOCK),)](
        text,
        first,
        value,
        status,
        count,
        text.numel(),
        MAX_BYTES=limits.token_bytes,
        MAX_SIGNIFICANT=limits.significant_digits,
        MAX_EXP_DIGITS=limits.exponent_digits,
        MAX_POWER=limits.exact_power,
        BLOCK=_BLOCK,
    )
    return value, status
