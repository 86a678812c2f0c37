"""JSON bodies <-> numpy arrays, strictly and without torch (the HTTP front-end processes decode
JSON forwards too; `service/codecs/json_tensors.py` makes tensors of these arrays in the engine).

orjson parses the body (it refuses NaN, Infinity and numbers beyond float64); each array of
numbers becomes one numpy array, with no per-element Python work beyond a type check (a JSON
`true` or `"0.5"` where a number belongs is refused, naming where, not read as 1.0 or 0.5), and
that check is one pass over the bytes when the arrays hold nothing but numbers. Decoding a body
costs a few times its size in transient memory (pydantic models of nested lists cost tens of
times, and hold the GIL for as long).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import orjson

from ..errors import BadInput

# The fields of a /v1 forward's JSON body (service.http.schemas.ForwardRequest, which imports torch)
FORWARD_FIELDS = ("hidden_states", "router_logits", "return_routing")
_NUMBERS = frozenset({float, int})
# every byte of a JSON number, and the brackets, commas and whitespace between them
_ARRAY_BYTES = b"0123456789+-.eE[], \t\n\r"
# what a number costs as JSON text at most, about: float32's shortest form (up to 15 bytes,
# 10-12 for most values) and its comma; sizes a reply's JSON before it is written
NUMBER_BYTES = 16
# A number at least this far from zero becomes an infinity as a float32: it lies halfway between
# float32's largest value and 2^128, or beyond, and rounds up (to the even neighbour)
FLOAT32_OVERFLOW = 2.0**128 - 2.0**103
FLOAT32_MAX = float(np.finfo(np.float32).max)


def parse(body: bytes | bytearray, what: str = "body") -> Any:
    """The JSON value of `body`; BadInput naming `what` and the position when it is not JSON,
    or holds a number no float64 can (which orjson refuses; JSON sets no range)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as err:
        # orjson's position counts characters, not bytes
        text = bytes(body).decode(errors="replace") if err.msg == _BEYOND_FLOAT64 else ""
        if number := _NUMBER.match(text, err.pos):
            text = number.group()
            text = text if len(text) <= _NUMBER_CHARS else text[:_NUMBER_CHARS] + "..."
            raise BadInput(
                f"{what} holds {text} at line {err.lineno} column {err.colno}, beyond "
                f"float64's range (±{np.finfo(np.float64).max:.8g})"
            ) from None
        raise BadInput(f"{what} is not valid JSON: {err}") from None


_BEYOND_FLOAT64 = "number is infinity when parsed as double"  # orjson's message
_NUMBER_CHARS = 40  # of such a number named in the error; a longer one is cut there
_NUMBER = re.compile(rf"-?[0-9][0-9.eE+-]{{0,{_NUMBER_CHARS}}}")


MAX_DIMS = 32  # numpy's limit in its 1.x releases; no tensor of ours comes near it


def _where(name: str, index: tuple[int, ...]) -> str:
    return name + "".join(f"[{i}]" for i in index)


def out_of_range(
    name: str, index: tuple[int, ...], number: float, dtype: str, largest: float
) -> BadInput:
    """The error for the number at `index` of array `name`, which a `dtype` cannot hold."""
    return BadInput(f"{_where(name, index)} is {number!r}, beyond {dtype}'s range (±{largest:.8g})")


def _innermost(name: str, value: list) -> Iterator[list]:
    """The innermost lists of the nested list `value` (those that do not hold only lists), in
    order; BadInput once they lie deeper than a tensor can (no recursion: JSON nested a
    thousand deep must not exhaust Python's stack)."""
    stack = [(value, 1)]
    while stack:
        items, depth = stack.pop()
        if items and all(isinstance(item, list) for item in items):
            if depth == MAX_DIMS:
                raise BadInput(f"{name} is nested more than {MAX_DIMS} arrays deep")
            stack.extend((item, depth + 1) for item in reversed(items))
        else:
            yield items


def _first_non_number(value: list, index: tuple[int, ...]) -> tuple[tuple[int, ...], Any]:
    """Where the first item that is not a number sits in a list `_innermost` yields, and it."""
    if value and all(isinstance(item, list) for item in value):
        for i, item in enumerate(value):
            found = _first_non_number(item, (*index, i))
            if found:
                return found
        return ()
    for i, item in enumerate(value):
        if type(item) not in _NUMBERS:
            return (*index, i), item
    return ()


def arrays_hold_only_numbers(body: bytes | bytearray, value: Any) -> bool:
    """Whether every item of every array in `value`, the parsed JSON object `body`, is a number
    or an array, found without visiting the items (much faster than the type checks; measured
    with `bench/json_bench.py`).

    Deleted from the text, the bytes of numbers, brackets, commas and whitespace leave of an
    array only its other items (strings, true, false, null, objects); of the rest of the object
    they leave what they leave of its compact form with every array emptied, never less (the
    body may escape more). So the two are equal exactly when the arrays hold nothing else, or
    differ and the caller checks each item."""
    if not isinstance(value, dict):
        return False
    skeleton = orjson.dumps({k: [] if isinstance(v, list) else v for k, v in value.items()})
    return body.translate(None, _ARRAY_BYTES) == skeleton.translate(None, _ARRAY_BYTES)


def to_array(name: str, value: Any, numbers_only: bool = False) -> np.ndarray:
    """A nested JSON array of numbers -> a float64 array of its shape. `numbers_only`:
    `arrays_hold_only_numbers` found no other items (an array where a number belongs is still
    named here)."""
    if not isinstance(value, list):
        raise BadInput(f"{name} must be an array of numbers")
    # set(map(type, ...)) runs in C: a type check per number, without a Python loop over them
    if not numbers_only and not all(
        set(map(type, numbers)) <= _NUMBERS for numbers in _innermost(name, value)
    ):
        index, item = _first_non_number(value, ())
        item_text = orjson.dumps(item).decode()
        raise BadInput(f"{_where(name, index)} is {item_text}; expected a number")
    try:
        return np.array(value, dtype=np.float64)
    except ValueError:  # nested lists of unequal lengths, or an array among numbers
        if numbers_only:
            return to_array(name, value)
        raise BadInput(f"{name} is ragged: its nested arrays have unequal lengths") from None


def rows_to_array(name: str, value: Any, numbers_only: bool = False) -> np.ndarray:
    """A JSON array of rows of numbers -> float64 [T, C]; refuses empty, ragged and non-number
    arrays, naming the row or the element. `numbers_only`: as `to_array`'s."""
    if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
        raise BadInput(f"{name} must be a [tokens, columns] array of numbers")
    if not value or not value[0]:
        raise BadInput(f"{name} is empty; expected a [tokens, columns] array of numbers")
    width = len(value[0])
    for i, row in enumerate(value):
        if len(row) != width:
            raise BadInput(f"{name} is ragged: row 0 has {width} values, row {i} has {len(row)}")
    if not numbers_only:
        return to_array(name, value)
    try:
        return _packed_rows(value, width)
    except struct.error:  # an array among the numbers: to_array names it
        return to_array(name, value)


def check_float32(name: str, array: np.ndarray) -> None:
    """BadInput naming the first number of `array` (float64, finite: orjson reads no other)
    that a float32 cannot hold: cast, it would become an infinity, which a forward refuses as
    though the client had sent one."""
    if array.size and (array.max() >= FLOAT32_OVERFLOW or array.min() <= -FLOAT32_OVERFLOW):
        index = tuple(int(i) for i in np.argwhere(np.abs(array) >= FLOAT32_OVERFLOW)[0])
        raise out_of_range(name, index, float(array[index]), "float32", FLOAT32_MAX)


@lru_cache(maxsize=64)
def _row_format(width: int) -> struct.Struct:
    return struct.Struct(f"{width}d")


def _packed_rows(rows: list[list], width: int) -> np.ndarray:
    """Rows of `width` numbers (ints and floats) -> float64 [T, width] through struct, a C loop
    over each row's numbers (PyFloat_AsDouble, as numpy converts them): faster than numpy's
    conversion of nested lists, which finds their shape first. struct.error when a row
    holds anything else (which would be an array here)."""
    row = _row_format(width)
    packed = bytearray(len(rows) * row.size)
    for i, numbers in enumerate(rows):
        row.pack_into(packed, i * row.size, *numbers)
    return np.frombuffer(packed, np.float64).reshape(len(rows), width)


@dataclass(frozen=True)
class ForwardArrays:
    """A /v1 forward's JSON body, decoded (schema: service.http.schemas.ForwardRequest)."""

    hidden_states: np.ndarray  # [T, H] float64, each number within float32's range
    router_logits: np.ndarray | None  # [T, E] float64, each number within float32's range
    return_routing: bool


def decode_forward_arrays(body: bytes | bytearray) -> ForwardArrays:
    """A /v1 forward's JSON body -> its arrays; BadInput naming the field or element."""
    value = parse(body)
    if not isinstance(value, dict):
        raise BadInput("body must be a JSON object with hidden_states")
    unknown = sorted(set(value) - set(FORWARD_FIELDS))
    if unknown:
        raise BadInput(f"unknown fields {unknown}; expected {list(FORWARD_FIELDS)}")
    if "hidden_states" not in value:
        raise BadInput("hidden_states is missing")
    logits = value.get("router_logits")
    routing = value.get("return_routing", False)
    if not isinstance(routing, bool):
        got = orjson.dumps(routing).decode()
        raise BadInput(f"return_routing must be true or false, got {got}")
    numbers_only = arrays_hold_only_numbers(body, value)
    hidden = rows_to_array("hidden_states", value["hidden_states"], numbers_only)
    check_float32("hidden_states", hidden)
    if logits is not None:
        logits = rows_to_array("router_logits", logits, numbers_only)
        check_float32("router_logits", logits)
    return ForwardArrays(hidden, logits, routing)


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """`value` as JSON; numpy arrays inside are written from their buffers, in the shortest
    decimal form of their dtype."""
    return orjson.dumps(value, default=default, option=orjson.OPT_SERIALIZE_NUMPY)
