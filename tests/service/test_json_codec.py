"""The JSON codec on its own: strict numbers named where they fail, shapes, and outputs written
in their dtype's shortest form."""

from __future__ import annotations

import re

import numpy as np
import orjson
import pytest
import torch

from moe_serve.service.codecs.json_numbers import (
    FLOAT32_MAX,
    FORWARD_FIELDS,
    arrays_hold_only_numbers,
    decode_forward_arrays,
    rows_to_array,
)
from moe_serve.service.codecs.json_tensors import array_to_tensor, decode_forward, dumps
from moe_serve.service.errors import BadInput
from moe_serve.service.http.schemas import ForwardRequest


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([[1, True]], "h[0][1] is true; expected a number"),
        ([[1, 2], [None, 3]], "h[1][0] is null; expected a number"),
        ([[1, [2]]], "h[0][1] is [2]; expected a number"),
        ([[1, 2], [3]], "h is ragged: row 0 has 2 values, row 1 has 1"),
        ([], "h is empty"),
        ([[]], "h is empty"),
        ({"a": 1}, "h must be a [tokens, columns] array of numbers"),
        ([1, 2], "h must be a [tokens, columns] array of numbers"),
    ],
)
def test_rows_that_are_not_a_matrix_of_numbers_are_named(value, message: str) -> None:
    with pytest.raises(BadInput, match=message.replace("[", r"\[")):
        rows_to_array("h", value)


def test_rows_become_one_float32_tensor_ints_included() -> None:
    t = decode_forward(orjson.dumps({"hidden_states": [[1, 2.5], [-3, 1e-8]]})).hidden_states
    assert t.dtype == torch.float32
    assert torch.equal(t, torch.tensor([[1.0, 2.5], [-3.0, 1e-8]]))


# float64 numbers about float32's largest value: the last below the point halfway to 2^128 rounds
# down to it; that point, and all beyond, round up to an infinity
BELOW_HALFWAY, HALFWAY = 3.4028235677973362e38, 3.4028235677973366e38


@pytest.mark.parametrize("field", ["hidden_states", "router_logits"])
@pytest.mark.parametrize(
    ("number", "shown"),
    [(1e39, "1e+39"), (-HALFWAY, "-3.4028235677973366e+38"), (1.7e308, "1.7e+308")],
)
def test_a_number_beyond_float32_is_named_not_read_as_an_infinity(
    field: str, number: float, shown: str
) -> None:
    rows = [[0.5, 1.0], [2.0, 3.0]]
    body = {"hidden_states": rows, "router_logits": rows}
    body[field] = [[0.5, 1.0], [2.0, number]]
    message = f"{field}[1][1] is {shown}, beyond float32's range (±3.4028235e+38)"
    for decode in (decode_forward_arrays, decode_forward):
        with pytest.raises(BadInput, match=re.escape(message)):
            decode(orjson.dumps(body))


@pytest.mark.parametrize(
    ("text", "shown"),
    [("1e400", "1e400 at line 2 column 33"), ("-1" + "0" * 400, "-1" + "0" * 38 + "... at")],
)
@pytest.mark.parametrize("before", ["ab", "é😀"], ids=["ascii", "wider-characters-before"])
def test_a_number_beyond_float64_is_named_with_where_it_stands(
    text: str, shown: str, before: str
) -> None:
    rows = f"[[0.5, 1.0],\n{' ' * 26}[2.0, {text}]]"
    body = f'{{"note": "{before}", "hidden_states": {rows}}}'.encode()
    for decode in (decode_forward_arrays, decode_forward):
        with pytest.raises(BadInput, match=re.escape(f"body holds {shown}")) as refused:
            decode(body)
        assert str(refused.value).endswith("beyond float64's range (±1.7976931e+308)")


def test_the_last_number_below_halfway_to_2_128_is_float32s_largest() -> None:
    decoded = decode_forward(orjson.dumps({"hidden_states": [[BELOW_HALFWAY, -BELOW_HALFWAY]]}))
    assert decoded.hidden_states.tolist() == [[FLOAT32_MAX, -FLOAT32_MAX]]


@pytest.mark.parametrize(
    ("dtype", "number", "message"),
    [
        (torch.float32, 1e39, "d[1] is 1e+39, beyond float32's range (±3.4028235e+38)"),
        (torch.float16, 65520.0, "d[1] is 65520.0, beyond float16's range (±65504)"),
        (torch.bfloat16, -3.4e38, "d[1] is -3.4e+38, beyond bfloat16's range (±3.3895314e+38)"),
    ],
    ids=str,
)
def test_kserve_data_beyond_its_dtype_is_named(dtype, number: float, message: str) -> None:
    with pytest.raises(BadInput, match=re.escape(message)):
        array_to_tensor("d", [1.0, number], [2], dtype)
    # the largest value rounds to itself; a NaN or an Infinity sent as one is left to the input
    # checks, which name it as such
    largest = torch.finfo(dtype).max
    assert array_to_tensor("d", [1.0, largest], [2], dtype)[1].item() == largest
    sent = array_to_tensor("d", [float("nan"), float("-inf")], [2], dtype)
    assert sent[0].isnan() and sent[1].item() == float("-inf")


@pytest.mark.parametrize("value", [[1, 2, 3, 4], [[1, 2], [3, 4]]], ids=["flat", "nested"])
def test_kserve_data_flat_or_nested_fills_its_shape(value) -> None:
    t = array_to_tensor("d", value, [2, 2], torch.float16)
    assert t.dtype == torch.float16
    assert torch.equal(t, torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float16))


def test_kserve_data_that_does_not_fill_its_shape_is_refused() -> None:
    with pytest.raises(BadInput, match=r"d: 3 values do not fill shape \[2, 2\]"):
        array_to_tensor("d", [1, 2, 3], [2, 2], torch.float32)


def test_decode_forward_reads_the_body_strictly() -> None:
    body = orjson.dumps({"hidden_states": [[1.0, 2.0]], "return_routing": True})
    decoded = decode_forward(body)
    assert decoded.return_routing is True
    assert decoded.router_logits is None
    assert torch.equal(decoded.hidden_states, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(BadInput, match="return_routing must be true or false, got 1"):
        decode_forward(orjson.dumps({"hidden_states": [[1.0]], "return_routing": 1}))
    with pytest.raises(BadInput, match=r"unknown fields \['hiden'\]"):
        decode_forward(orjson.dumps({"hidden_states": [[1.0]], "hiden": 1}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_outputs_are_written_exactly_in_their_dtype(dtype: torch.dtype) -> None:
    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    back = torch.tensor(orjson.loads(dumps({"output": t}))["output"], dtype=torch.float64)
    assert torch.equal(back.to(dtype), t)


@pytest.mark.parametrize(
    "body",
    [
        b'{"hidden_states": [[1, -2.5e-3], [3E+2, 0]]}',
        b'{ "hidden_states" :\n[[1,2]\t, [3,4]], "return_routing": true, "router_logits": null }',
        b'{"router_logits": [[0.5]], "hidden_states": [[1]], "return_routing": false}',
    ],
)
def test_arrays_of_only_numbers_are_found_without_visiting_them(body: bytes) -> None:
    assert arrays_hold_only_numbers(body, orjson.loads(body))


@pytest.mark.parametrize(
    "body",
    [
        b'{"hidden_states": [[1, "2"]]}',
        b'{"hidden_states": [[1, "e"]]}',  # a string of number bytes still leaves its quotes
        b'{"hidden_states": [[1, true]]}',
        b'{"hidden_states": [[1, null]]}',
        b'{"hidden_states": [[1, {}]]}',
        b'{"hidden_states": [[1, 2]], "router_logits": [[false]]}',
        b'{"hidden_states": [[1, 2]], "return_routing": [true]}',
        b'{"hidden\\u005fstates": [[1, 2]]}',  # an escaped key: the items are checked instead
        b'{"hidden_states": [[1]], "hidden_states": [[2]]}',  # a repeated key
        b"[[1, 2]]",
    ],
)
def test_anything_else_in_or_around_the_arrays_sends_them_to_the_item_checks(body: bytes) -> None:
    assert not arrays_hold_only_numbers(body, orjson.loads(body))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"hidden_states": [[1, [2]]]}', r"hidden_states\[0\]\[1\] is \[2\]; expected a number"),
        (b'{"hidden_states": [[1, 2]], "router_logits": [[1, "x"]]}', "router_logits"),
        (b'{"hidden_states": [[1, true]], "return_routing": true}', "is true; expected a number"),
    ],
)
def test_decode_forward_names_what_is_not_a_number(body: bytes, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        decode_forward(body)


def test_decode_forward_equals_the_item_checked_decode() -> None:
    rows = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)).tolist()
    rows[1][2] = 3  # ints too
    body = orjson.dumps({"hidden_states": rows, "router_logits": rows})
    decoded = decode_forward(body)
    checked = torch.from_numpy(rows_to_array("h", rows)).float()  # each item's type checked
    assert torch.equal(decoded.hidden_states, checked)
    assert torch.equal(decoded.router_logits, checked)


AWKWARD_NUMBERS = [0, -0.0, 3, -7, 2**53 + 1, 2**63 + 1, 18446744073709551615, 5e-324, 1e-45,
                   1.5e-39, 1e39, -1.7976931348623157e308, 0.1, 1 / 3]  # fmt: skip


@pytest.mark.parametrize(
    "rows",
    [
        [AWKWARD_NUMBERS],
        [[x] for x in AWKWARD_NUMBERS],
        orjson.loads(orjson.dumps(torch.randn(37, 129, dtype=torch.float64).tolist())),
    ],
    ids=["one row", "one column", "37x129"],
)
def test_rows_of_only_numbers_convert_bit_for_bit_as_numpy_converts_them(rows) -> None:
    # numbers_only takes the packed path; numpy's conversion of the nested lists is its twin
    packed = rows_to_array("h", rows, numbers_only=True)
    expected = np.array(rows, dtype=np.float64)
    assert packed.shape == expected.shape
    assert packed.tobytes() == expected.tobytes()


def test_an_array_among_numbers_found_only_by_the_packed_path_is_named() -> None:
    with pytest.raises(BadInput, match=r"h\[1\]\[2\] is \[5\]; expected a number"):
        rows_to_array("h", [[1, 2, 3], [4, 5, [5]]], numbers_only=True)


def test_the_forward_fields_are_the_schemas() -> None:
    assert list(FORWARD_FIELDS) == list(ForwardRequest.model_fields)
