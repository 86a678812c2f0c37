"""service/codecs/json_device.py against the host path (service/codecs/json_tensors.py): the same
numbers read, the same text written, and every body it does not take left to the host, which
explains it. The torch ops run on the CPU here, the Triton kernels in the interpreter against them;
the gpu-marked tests and tests/service/test_gpu.py read bodies with the kernels on a GPU."""

import json
import random
import re

import numpy as np
import orjson
import pytest
import torch

from moe_serve.service.codecs import json_device, json_tensors
from moe_serve.service.errors import BadInput

CPU = torch.device("cpu")
WHERE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the kernels' device


def host(body: bytes) -> torch.Tensor:
    return json_tensors.decode_forward(body).hidden_states


def device(body: bytes) -> torch.Tensor | None:
    parsed = json_device.decode_forward(body, CPU)
    return None if parsed is None else parsed.hidden_states


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (-0.0 is not 0.0)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def body_of(text: str) -> bytes:
    return b'{"hidden_states": ' + text.encode() + b"}"


@pytest.mark.parametrize(
    "rows",
    [
        torch.randn(7, 33, generator=torch.Generator().manual_seed(0)).bfloat16().float().tolist(),
        torch.randn(
            3, 5, generator=torch.Generator().manual_seed(1)
        ).tolist(),  # float32's 17 digits
        np.random.default_rng(2).standard_normal((4, 9)).tolist(),  # float64's
        (np.random.default_rng(3).standard_normal((2, 50)) * 1e-7).tolist(),  # 1e-08 and so
        (np.random.default_rng(4).standard_normal((2, 50)) * 1e12).tolist(),
        [[0, -0.0, 0.0, 1, -1, 10, 100, 1e22, 1e-22, 123456789012345678]],
        [[3.4028234663852886e38, -1.2e-38, 3.4e38]],
        [[5]],
    ],
    ids=[
        "bf16",
        "float32",
        "float64",
        "small",
        "large",
        "integers-and-zeros",
        "float32-edges",
        "1x1",
    ],
)
def test_json_dumps_bodies_read_as_the_host_reads_them(rows: list) -> None:
    for text in (json.dumps(rows), json.dumps(rows, indent=2), orjson.dumps(rows).decode()):
        body = body_of(text)
        got = device(body)
        assert got is not None, text[:80]
        assert same(got, host(body))


def test_hand_written_numbers() -> None:
    text = "[[1e5, 1E+2, 2.5e-3, -0, -0.0, 0e0, 1.5E-05, 0.000123, 10.25, -7e+01 ,\t3\n]]"
    assert same(device(body_of(text)), host(body_of(text)))


def test_an_orjson_float32_reply_reads_back_exactly() -> None:
    values = torch.randn(16, 300, generator=torch.Generator().manual_seed(5))
    text = json_tensors.dumps(values).decode()
    assert same(device(body_of(text)), values)


@pytest.mark.parametrize(
    ("body", "routing"),
    [
        (b'{"hidden_states": [[1, 2]]}', False),
        (b' {\n "hidden_states" :[[1,2]] , "return_routing": true }\n', True),
        (b'{"return_routing": false, "hidden_states": [[1, 2]]}', False),
        (b'{"return_routing":true,"hidden_states":[[1,2]]}', True),
    ],
)
def test_forward_span_finds_the_rows_and_return_routing(body: bytes, routing: bool) -> None:
    span = json_device.forward_span(body)
    assert span is not None
    assert orjson.loads(body[span[0]]) == [[1, 2]]
    assert span[1] is routing
    parsed = json_device.decode_forward(body, CPU)
    assert parsed.return_routing is routing and parsed.hidden_states.tolist() == [[1.0, 2.0]]


@pytest.mark.parametrize(
    "body",
    [
        b'{"hidden_states": [[1]], "router_logits": [[1, 2]]}',
        b'{"router_logits": [[1]], "hidden_states": [[1]]}',
        b'{"return_routing": true, "hidden_states": [[1]], "return_routing": false}',
        b'{"hidden_states": [[1]], "return_routing": 1}',
        b'{"hidden_states": [[1]]',
        b'{"hidden_states": [[1]]} {}',
        b'["hidden_states", [[1]]]',
    ],
)
def test_other_bodies_are_left_to_the_host(body: bytes) -> None:
    assert json_device.decode_forward(body, CPU) is None


INVALID = [
    "[[01]]",
    "[[-01.5]]",
    "[[1.]]",
    "[[.5]]",
    "[[-]]",
    "[[1e]]",
    "[[1e+]]",
    "[[+1]]",
    "[[1.2.3]]",
    "[[1e5e5]]",
    "[[1e5.3]]",
    "[[--1]]",
    "[[1-2]]",
    "[[1 2]]",
    "[[1,,2]]",
    "[[1,2,]]",
    "[[1],]",
    "[[1],[2]",
    "[[1]]]",
    "[[1],[2,3]]",
    "[[]]",
    "[]",
    "[1, 2]",
    "[[1], 2]",
    "[[1] [2]]",
    "[[NaN]]",
    "[[Infinity]]",
    "[[true]]",
    "[[null]]",
    '[["1"]]',
    "[[0x10]]",
    "[[1]],",
    "",
]


@pytest.mark.parametrize("text", INVALID)
def test_what_is_not_json_rows_is_left_to_the_host_which_names_it(text: str) -> None:
    body = body_of(text)
    assert device(body) is None
    with pytest.raises(BadInput):
        host(body)


@pytest.mark.parametrize(
    "text",
    [
        "[[0.1234567890123456789]]",  # 19 significant digits
        "[[1e-50]]",
        "[[1e400]]",  # beyond float64: the host refuses it
        "[[1e0001]]",  # a four-digit exponent
        "[[1.1754943508222875e-38]]",  # float32's smallest normal, in float64's 17 digits
        "[[1, 1e39]]",  # beyond float32: an infinity, which the host names
        "[[-3.5e38]]",
        "[[9e44]]",
        "[[[1]]]",  # three dimensions (the layer's shape check refuses them)
    ],
)
def test_what_the_fast_reading_does_not_take_is_left_to_the_host(text: str) -> None:
    assert device(body_of(text)) is None


def test_leading_zeros_do_not_count_as_digits() -> None:
    text = "[[0.00012345678901234567, -0.000000000000000000001]]"
    assert same(device(body_of(text)), host(body_of(text)))


def test_mutated_bodies_are_read_as_the_host_reads_them_or_left_to_it() -> None:
    """Random edits with JSON's number and structure bytes: where the device reads a body, the
    host reads the same numbers from it."""
    rng = random.Random(6)
    base = json.dumps(
        torch.randn(3, 4, generator=torch.Generator().manual_seed(7)).bfloat16().float().tolist()
    )
    alphabet = "0123456789-+.eE[], "
    taken = 0
    for _ in range(600):
        text = list(base)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text))
            edit = rng.choice(("insert", "delete", "replace"))
            if edit == "insert":
                text.insert(i, rng.choice(alphabet))
            elif edit == "delete":
                del text[i]
            else:
                text[i] = rng.choice(alphabet)
        body = body_of("".join(text))
        got = device(body)
        if got is not None:
            taken += 1
            assert same(got, host(body)), body
    assert taken > 50  # the edits leave many bodies valid


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_value_is_printed_as_the_host_prints_it(dtype: torch.dtype) -> None:
    bits = torch.arange(1 << 16, dtype=torch.int32)
    values = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(dtype)
    finite = values[torch.isfinite(values.float())]
    for shape in ((256, -1), (-1, 7), (1, -1)):
        n = finite.numel() // 7 * 7 if shape == (-1, 7) else finite.numel()
        rows = finite[:n].reshape(shape)
        assert bytes(json_device.print_rows(rows)) == json_tensors.dumps(rows)


@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (4, 1), (3, 64)])
def test_printed_rows_of_awkward_shapes(shape: tuple[int, int]) -> None:
    rows = torch.randn(shape, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert bytes(json_device.print_rows(rows)) == json_tensors.dumps(rows)


def _printed_by_kernels(rows: torch.Tensor, block: int) -> bytes:
    """`json_device.print_rows` on a GPU (here: the interpreter), in blocks of `block` values."""
    from moe_serve.service.codecs.json_print_kernel import write_rows

    on = rows.to(WHERE)
    text, length = write_rows(on, *json_device._number_table(rows.dtype, WHERE), block=block)
    return bytes(text[: int(length)].cpu().numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (4, 1), (3, 7), (5, 16), (2, 33)])
def test_the_kernels_print_rows_as_the_host_does(shape: tuple[int, int], dtype) -> None:
    """In blocks of 16 values: rows that end inside a block, at its end, across blocks, and a
    last block partly empty; values of every length (subnormals, powers, signs, zeros)."""
    n = shape[0] * shape[1]
    bits = torch.randint(0, 1 << 16, (n,), generator=torch.Generator().manual_seed(n))
    rows = bits.to(torch.int16).view(dtype)
    rows = torch.where(rows.isfinite(), rows, 0).reshape(shape)
    assert _printed_by_kernels(rows, 16) == json_tensors.dumps(rows)


def test_the_kernels_print_a_row_of_7168_as_the_host_does() -> None:
    """A DeepSeek-V3 token's output, in the kernels' own blocks."""
    from moe_serve.service.codecs.json_print_kernel import BLOCK_VALUES

    rows = torch.randn(1, 7168, generator=torch.Generator().manual_seed(18)).bfloat16()
    assert _printed_by_kernels(rows, BLOCK_VALUES) == json_tensors.dumps(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_a_gpu_every_16_bit_value_is_printed_as_the_host_prints_it(dtype) -> None:
    bits = torch.arange(1 << 16, dtype=torch.int32)
    values = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(dtype)
    finite = values[torch.isfinite(values.float())]
    for shape in ((256, -1), (-1, 7), (1, -1), (64, 1)):
        n = {(-1, 7): finite.numel() // 7 * 7, (64, 1): 64}.get(shape, finite.numel())
        rows = finite[:n].reshape(shape)
        assert bytes(json_device.print_rows(rows.cuda())) == json_tensors.dumps(rows)


def test_a_reply_is_the_host_path_s_reply() -> None:
    output = torch.randn(2, 3, generator=torch.Generator().manual_seed(9)).bfloat16()
    rest = {
        "layer": "demo",
        "tokens": 2,
        "backend": "torch",
        "topk_ids": torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
        "topk_weights": torch.tensor([[0.75, 0.25], [0.5, 0.5]]),
    }
    reply = b"".join(json_device.print_reply(output, rest))
    assert reply == json_tensors.dumps({"output": output} | rest)
    assert orjson.loads(reply)["topk_ids"] == [[1, 0], [2, 3]]


@pytest.mark.parametrize("room", [0, -1], ids=["fits exactly", "a byte short"])
def test_a_reply_printed_into_memory_is_print_reply_s_or_is_not_written(room: int) -> None:
    output = torch.randn(3, 5, generator=torch.Generator().manual_seed(4)).bfloat16()
    rest = {"layer": "demo", "tokens": 3, "backend": "torch"}
    reply = b"".join(json_device.print_reply(output, rest))
    into = bytearray(b"#" * (len(reply) + room))
    written = json_device.print_reply_into(output, rest, memoryview(into))
    if room == 0:
        assert (written, bytes(into)) == (len(reply), reply)
    else:
        assert b"".join(written) == reply
        assert into == b"#" * len(into)


def test_without_device_memory_the_host_reads_and_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(json_device, "parse_rows", no_memory)
    monkeypatch.setattr(json_device, "_rows_text", no_memory)
    assert device(body_of("[[1, 2]]")) is None
    output = torch.ones(1, 2, dtype=torch.bfloat16)
    reply = b"".join(json_device.print_reply(output, {"layer": "demo"}))
    assert reply == json_tensors.dumps({"output": output, "layer": "demo"})
    into = memoryview(bytearray(len(reply)))
    printed = json_device.print_reply_into(output, {"layer": "demo"}, into)
    assert printed == [reply] and not any(into)  # the caller copies it in


def _classes(text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = json_device._class_table(text.device)[text.int()]
    number = (c >= json_device.DIGIT) & (c <= json_device.EXP)
    starts = number & ~json_device._before(number, False)
    return c, starts, starts.nonzero().squeeze(1)


def _mutations(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    base = json.dumps([[0.5, -1e-05, 2e3, -0.0], [1, 0.125, -7.25e-3, 12]])
    out = []
    for _ in range(count):
        text = list(base)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text))
            text[i : i + rng.randint(0, 1)] = rng.choice("0123456789-+.eE, ")
        out.append("".join(text))
    return out


KERNEL_CASES = [
    "[[1e5, 1E+2, 2.5e-3, -0, -0.0, 0e0, 1.5E-05, 0.000123, 10.25, -7e+01 ,\t3\n]]",
    json.dumps(torch.randn(4, 9, generator=torch.Generator().manual_seed(10)).tolist()),
    json.dumps((np.random.default_rng(11).standard_normal((2, 8)) * 1e-30).tolist()),
    "[[0.1234567890123456789, 123456789012345678, 1e-44, 1e-45, 9e44, 1e0001, 1e999]]",
    "[[1e39, -3.5e38, 3.4e38, 3.4028234663852886e38, -3.40282357e38, 3.4028235e38]]",
    "[[" + "1" * 40 + ", " + "1" * 41 + "]]",
    *INVALID[:-1],
]


def _read_alone(token: bytes) -> torch.Tensor | None:
    """A number's float32 [1] as `json_device.read_numbers` reads it alone; None where it
    refuses it."""
    raw = torch.frombuffer(bytearray(token), dtype=torch.uint8)
    read = json_device.read_numbers(raw, *_classes(raw))
    return None if read is None or read[1] else read[0]


def test_the_kernels_read_numbers_as_the_torch_ops_do() -> None:
    """service/codecs/json_device_kernel.py (run by the interpreter here, on the GPU in
    test_gpu.py) against `json_device.read_numbers`: the same numbers, the same refusals, number
    by number. The kernels read every text's numbers in one run over the texts joined by spaces
    (no array of rows: refused, its numbers read all the same): a number is read from its first
    byte to the next byte that is none of a number's, and the interpreter's cost is a run's,
    whatever its numbers."""
    from moe_serve.service.codecs.json_device_kernel import read_rows

    joined = " ".join(KERNEL_CASES + _mutations(30, 12)).encode()
    tokens = re.findall(rb"[0-9eE+.-]+", joined)
    text = torch.frombuffer(bytearray(joined), dtype=torch.uint8).to(WHERE)
    values, verdict = read_rows(text, json_device.LIMITS)
    assert verdict.tolist()[0] == 1
    refused = 0
    for token, value in zip(tokens, values[: len(tokens)].cpu(), strict=True):
        expected = _read_alone(token)
        if expected is None:
            refused += 1
            assert value.isnan(), token
        else:
            assert same(value[None], expected), token
    assert 20 < refused < len(tokens) - 200


def _read_by_kernels(text: bytes, block: int) -> torch.Tensor | None:
    """`json_device.parse_rows` on a GPU (here: the interpreter), in blocks of `block` bytes."""
    from moe_serve.service.codecs.json_device_kernel import read_rows

    raw = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(WHERE)
    got = json_device._shaped(*read_rows(raw, json_device.LIMITS, block=block))
    return None if got is None else got.cpu()


def _read_by_torch(text: bytes) -> torch.Tensor | None:
    return json_device.parse_rows(torch.frombuffer(bytearray(text), dtype=torch.uint8))


# in blocks of 16 bytes: events, numbers and runs of whitespace that straddle blocks, and blocks
# that hold no event, at either end and inside
TAKEN_ROWS = [
    "[[1]]",
    "[[1, 2, 3]]",
    "[[1, 2], [3, 4], [5, 6]]",
    "  [[ 1 , 2 ]\n,[3,4]]  ",
    "[" + " " * 40 + "[1]" + "\t" * 40 + "," + " " * 40 + "[2]" + "\n" * 40 + "]",
    "[[" + ", ".join(["-1234.5678e-3", "0.000123456789", "-0"] * 4) + "]]",
    "[[1.5]" + " " * 70 + "]",
    " " * 50 + "[[-0.0, 2e-5], [7, 8]]" + " " * 50,
    json.dumps(torch.randn(3, 5, generator=torch.Generator().manual_seed(15)).tolist(), indent=1),
]
REFUSED_ROWS = [
    "[[[1]]]",
    "[[[1]], [2]]",
    "[[1], [[2]]]",
    "[[]]",
    "[[], []]",
    "[[1], []]",
    "[[], [1]]",
    "[[1, 2], [3]]",
    "[[1], [2, 3]]",
    "[[1, 2], [3, 4], [5]]",
    "[[1, 2], [3, 4, 5], [6]]",
    "[[1, 2]," + " " * 40 + "[3, 4, 5]," + " " * 40 + "[6]]",
    "[[1,],[2]]",
    "[[1],]",
    "[[1]],",
    ",[[1]]",
    "[[1]] [[1]]",
    "[[,1]]",
    "[[1],,[2]]",
    "[[1]]x",
    "[[1]" + " " * 40 + "x]",
    "[[1\x00]]",
    '[[1, "2"]]',
    "[[1]]]",
    "[[[1]]",
    "[[1]",
    "[[1]" + " " * 70,
    "[[1 2]]",
    "[[1" + " " * 40 + "2]]",
    "[[1e5e5, 2]]",
    "[[" + "1" * 41 + "]]",
    "]",
    "[",
    " " * 40,
    "[1]",
    "1",
]


@pytest.mark.parametrize(
    ("text", "taken"), [(t, True) for t in TAKEN_ROWS] + [(t, False) for t in REFUSED_ROWS]
)
def test_the_kernels_read_rows_as_the_torch_ops_do(text: str, taken: bool) -> None:
    """parse_rows' kernels against its torch ops: the same rows, bit for bit, the same
    refusals."""
    expected = _read_by_torch(text.encode())
    assert (expected is not None) == taken
    got = _read_by_kernels(text.encode(), 16)
    assert (got is not None) == taken
    if taken:
        assert same(got, expected)


def test_the_kernels_read_mutated_rows_as_the_torch_ops_do() -> None:
    """Random edits with the structure's bytes, JSON's number bytes and runs of whitespace, in
    blocks of 16 bytes: the kernels take what the torch ops take and read the same rows."""
    rng = random.Random(16)
    base = "[[0.5, -1e-05], [2e3, -0.0], [7, 12.25]]"
    taken = 0
    for _ in range(30):
        text = list(base)
        for _ in range(rng.randint(1, 2)):
            if rng.random() < 0.5:  # whitespace before a bracket, a comma or a space: still rows
                i = rng.choice([k for k, ch in enumerate(text) if ch in "[], "])
                text.insert(i, rng.choice(" \n\t") * rng.randint(1, 40))
            else:
                i = rng.randrange(len(text))
                text[i : i + rng.randint(0, 1)] = rng.choice("[],-5 ")
        body = "".join(text).encode()
        expected, got = _read_by_torch(body), _read_by_kernels(body, 16)
        assert (got is None) == (expected is None), body
        if got is not None:
            taken += 1
            assert same(got, expected), body
    assert taken >= 10


def test_the_kernels_read_a_row_of_7168_as_the_torch_ops_do() -> None:
    """A DeepSeek-V3 token's hidden states, in the kernels' own blocks."""
    from moe_serve.service.codecs.json_device_kernel import BLOCK_BYTES

    rows = torch.randn(1, 7168, generator=torch.Generator().manual_seed(17)).bfloat16().float()
    text = json.dumps(rows.tolist()).encode()
    got = _read_by_kernels(text, BLOCK_BYTES)
    assert got is not None and same(got, _read_by_torch(text)) and same(got, rows)


@pytest.mark.gpu
def test_on_a_gpu_bodies_are_read_as_the_host_reads_them() -> None:
    """The kernels' path (parse_rows on a GPU) on mutated bodies and a million random values of
    every magnitude from 1e-20 to 1e20, float64's 17 digits and float32's."""
    cuda = torch.device("cuda")
    rng = np.random.default_rng(14)
    values = [
        rng.choice([-1, 1], 400_000) * 10 ** rng.uniform(-20, 20, 400_000),
        rng.standard_normal(400_000),
        rng.standard_normal(400_000).astype(np.float32).astype(np.float64),
    ]
    bodies = [body_of(t) for t in KERNEL_CASES + _mutations(500, 13)]
    bodies += [body_of(json.dumps(v.reshape(400, 1000).tolist())) for v in values]
    taken = 0
    for body in bodies:
        parsed = json_device.decode_forward(body, cuda)
        if parsed is not None:
            taken += 1
            assert same(parsed.hidden_states.cpu(), host(body)), body[:200]
    assert taken > 50
    assert all(json_device.decode_forward(b, cuda) is not None for b in bodies[-3:])


def test_warm_up_reads_its_body_and_builds_the_print_tables() -> None:
    """The start-up warm-up's own check passes (the ops run on the CPU here), and it leaves the
    16-bit dtypes' tables built, not float32's."""
    json_device._number_table.cache_clear()
    json_device.warm_up(CPU, [torch.bfloat16, torch.float16, torch.float32])
    assert json_device._number_table.cache_info().currsize == 2


@pytest.mark.gpu
def test_after_warm_up_no_body_compiles_the_kernels_again() -> None:
    """The engine warms the device path at start-up (service/core/runtime.py); the kernels are
    compiled once for every body (no specialisation on the number, block or byte counts), so the
    first large request of a served layer finds them compiled; so are the printing kernels."""
    from moe_serve.service.codecs import json_device_kernel as read
    from moe_serve.service.codecs import json_print_kernel as print_

    cuda = torch.device("cuda")
    json_device.warm_up(cuda, [torch.bfloat16, torch.float32])
    kernels = (read._count_kernel, read._place_kernel, read._read_kernel)
    kernels += (print_._size_kernel, print_._write_kernel)
    compiled = [kernel.device_caches[torch.cuda.current_device()][0] for kernel in kernels]
    after_warm_up = [len(variants) for variants in compiled]
    assert min(after_warm_up) >= 1
    for numbers in (1, 16, 17, 1024, 4099):
        body = body_of(json.dumps([[0.5] * numbers]))
        assert json_device.decode_forward(body, cuda) is not None
        json_device.print_rows(torch.ones(3, numbers, dtype=torch.bfloat16, device=cuda))
    assert [len(variants) for variants in compiled] == after_warm_up
    assert json_device._number_table.cache_info().currsize >= 1  # bfloat16's print table
