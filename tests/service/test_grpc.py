"""KServe v2 over gRPC with the stock tritonclient.grpc against a real server (HTTP beside it,
one batcher)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from moe_serve.service import logs
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import (
    NO_ROUTER,
    TINY,
    E,
    H,
    free_port,
    reference_forward,
    running_server,
    tiny_loader,
)

# a test dependency; the GPU machine lacks it (its CPU twin runs these in CI)
grpcclient = pytest.importorskip("tritonclient.grpc")
TOKEN = "grpc-test-token-0123456789"
SERVICE = "inference.GRPCInferenceService"


@pytest.fixture(scope="module")
def urls() -> Iterator[tuple[str, str]]:
    """(HTTP base URL, gRPC host:port) of one server."""
    port = free_port()
    app = create_app(
        Settings(device="cpu", grpc_port=port, max_batch_delay_ms=1.0, max_queue=2), tiny_loader
    )
    with running_server(app) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield url, f"127.0.0.1:{port}"


@pytest.fixture
def client(urls: tuple[str, str]) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(urls[1]) as c:
        yield c


def _input(name: str, array: np.ndarray) -> grpcclient.InferInput:
    datatype = {np.float32: "FP32", np.float16: "FP16"}[array.dtype.type]
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_grpc_infer_matches_the_reference(client, dtype) -> None:
    x = np.random.default_rng(0).standard_normal((5, H)).astype(dtype)
    result = client.infer(
        TINY,
        [_input("hidden_states", x)],
        outputs=[grpcclient.InferRequestedOutput("output")],
        request_id="req-9",
    )
    out = result.as_numpy("output")
    assert out.dtype == dtype and out.shape == (5, H)
    expected = reference_forward(TINY, torch.from_numpy(x)).to(torch.from_numpy(x).dtype)
    torch.testing.assert_close(torch.tensor(out), expected)
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("req-9", TINY, "1")


def test_grpc_typed_contents_are_read_like_raw_ones(client) -> None:
    """tritonclient sends raw bytes; a client may send typed contents (fp32_contents)."""
    from tritonclient.grpc import service_pb2 as pb

    x = np.random.default_rng(1).standard_normal((2, H)).astype(np.float32)
    request = pb.ModelInferRequest(model_name=TINY)
    tensor = request.inputs.add(name="hidden_states", datatype="FP32", shape=[2, H])
    tensor.contents.fp32_contents.extend(x.flatten().tolist())
    response = client._client_stub.ModelInfer(request)
    out = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(2, H)
    torch.testing.assert_close(torch.tensor(out), reference_forward(TINY, torch.from_numpy(x)))


def test_grpc_large_typed_contents_are_decoded_off_the_event_loop(client, monkeypatch) -> None:
    """Over 1 MiB of fp32_contents (service/off_loop.py's BINARY): the loop keeps answering."""
    from tritonclient.grpc import service_pb2 as pb

    from moe_serve.service.grpc import servicer

    decoded_on_loop = []

    def decode(message: pb.ModelInferRequest) -> object:
        try:
            asyncio.get_running_loop()
            decoded_on_loop.append(True)
        except RuntimeError:
            decoded_on_loop.append(False)
        return decode_infer(message)

    decode_infer = servicer.decode_infer
    monkeypatch.setattr(servicer, "decode_infer", decode)
    x = np.random.default_rng(4).standard_normal((4200, H)).astype(np.float32)  # 1.08 MB
    request = pb.ModelInferRequest(model_name=TINY)
    tensor = request.inputs.add(name="hidden_states", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel())
    response = client._client_stub.ModelInfer(request)
    out = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(x.shape)
    torch.testing.assert_close(torch.tensor(out), reference_forward(TINY, torch.from_numpy(x)))
    assert decoded_on_loop == [False]


def test_grpc_typed_contents_in_a_field_not_their_datatypes_are_invalid_argument(client) -> None:
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=TINY)
    tensor = request.inputs.add(name="hidden_states", datatype="FP32", shape=[1, H])
    tensor.contents.fp32_contents.extend([0.5] * H)
    tensor.contents.int_contents.extend([1])
    with pytest.raises(grpcclient.grpc.RpcError) as err:
        client._client_stub.ModelInfer(request)
    assert err.value.code() == grpcclient.grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "input hidden_states: FP32 values go in fp32_contents, not ['int_contents', "
        "'fp32_contents']"
    )


@pytest.mark.parametrize(
    ("datatype", "field", "message"),
    [
        ("FP64", "fp64_contents", "datatype 'FP64' is not supported; expected one of FP32"),
        ("INT32", "int_contents", "datatype 'INT32' is not supported"),
        ("INT64", "int64_contents", "datatype 'INT64' is not supported"),
        ("FP16", "fp32_contents", "FP16 must be sent in raw_input_contents"),
    ],
)
def test_grpc_typed_contents_no_layer_takes_are_invalid_argument(
    client, datatype, field, message
) -> None:
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=TINY)
    tensor = request.inputs.add(name="hidden_states", datatype=datatype, shape=[1, H])
    getattr(tensor.contents, field).extend([1] * H)
    with pytest.raises(grpcclient.grpc.RpcError) as err:
        client._client_stub.ModelInfer(request)
    assert err.value.code() == grpcclient.grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_grpc_parameters_with_no_value_are_invalid_argument(client) -> None:
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=TINY)
    request.parameters["priority"].Clear()  # present, with none of its values set
    tensor = request.inputs.add(name="hidden_states", datatype="FP32", shape=[1, H])
    tensor.contents.fp32_contents.extend([0.5] * H)
    with pytest.raises(grpcclient.grpc.RpcError) as err:
        client._client_stub.ModelInfer(request)
    assert err.value.code() == grpcclient.grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "parameter 'priority' has no value set"
    load = pb.RepositoryModelLoadRequest(model_name=TINY)
    load.parameters["config"].Clear()
    with pytest.raises(grpcclient.grpc.RpcError) as err:
        client._client_stub.RepositoryModelLoad(load)
    assert err.value.code() == grpcclient.grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_classification_asked_by_the_stock_client_is_invalid_argument(client) -> None:
    x = np.zeros((1, H), dtype=np.float32)
    asked = grpcclient.InferRequestedOutput("output", class_count=3)
    with pytest.raises(grpcclient.InferenceServerException) as err:
        client.infer(TINY, [_input("hidden_states", x)], outputs=[asked])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "classification is not supported" in err.value.message()


def test_grpc_sends_router_logits(client) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, H)).astype(np.float32)
    logits = rng.standard_normal((3, E)).astype(np.float32)
    inputs = [_input("hidden_states", x), _input("router_logits", logits)]
    out = client.infer(NO_ROUTER, inputs).as_numpy("output")
    expected = reference_forward(NO_ROUTER, torch.from_numpy(x), torch.from_numpy(logits))
    torch.testing.assert_close(torch.tensor(out), expected)


def test_grpc_health_and_metadata(client) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(TINY)
    assert client.is_model_ready(TINY, "1")
    assert not client.is_model_ready(TINY, "2")
    assert not client.is_model_ready("nope")
    assert "binary_tensor_data" in client.get_server_metadata(as_json=True)["extensions"]
    meta = client.get_model_metadata(TINY, as_json=True)
    assert meta["versions"] == ["1"]
    assert meta["inputs"][0] == {
        "name": "hidden_states",
        "datatype": "FP32",
        "shape": ["-1", str(H)],
    }
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": ["-1", str(H)]}]


GRPC_ERRORS = {
    "wrong width": (
        TINY,
        [("hidden_states", np.zeros((2, H + 3), np.float32))],
        "INVALID_ARGUMENT",
        "hidden_states has 67 columns",
    ),
    "unknown model": (
        "nope",
        [("hidden_states", np.zeros((1, H), np.float32))],
        "NOT_FOUND",
        "no layer named 'nope'",
    ),
    "unknown input": (
        TINY,
        [("hidden_states", np.zeros((1, H), np.float32)), ("mask", np.zeros((1, H), np.float32))],
        "INVALID_ARGUMENT",
        "unknown inputs \\['mask'\\]",
    ),
    "no router": (
        NO_ROUTER,
        [("hidden_states", np.zeros((1, H), np.float32))],
        "INVALID_ARGUMENT",
        "has no stored router",
    ),
    "NaN": (
        TINY,
        [("hidden_states", np.full((1, H), np.nan, np.float32))],
        "INVALID_ARGUMENT",
        "holds NaN or Inf",
    ),
}


@pytest.mark.parametrize(
    ("model", "inputs", "code", "message"), GRPC_ERRORS.values(), ids=GRPC_ERRORS
)
def test_grpc_errors_are_status_codes_naming_the_problem(
    client, model, inputs, code, message
) -> None:
    with pytest.raises(grpcclient.InferenceServerException, match=message) as err:
        client.infer(model, [_input(n, a) for n, a in inputs])
    assert err.value.status() == f"StatusCode.{code}"


def _infer_message(shape: list[int], **parameters: tuple[str, object]) -> bytes:
    """A ModelInferRequest for TINY with no bytes, serialized; parameters as (field, value)."""
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=TINY)
    request.inputs.add(name="hidden_states", datatype="FP32", shape=shape)
    for key, (field, value) in parameters.items():
        setattr(request.parameters[key], field, value)
    values = math.prod(shape)
    request.raw_input_contents.append(bytes(4 * values if values < 1 << 20 else 0))
    return request.SerializeToString()


GOOD = _infer_message([1, H])


def _typed_and_raw() -> bytes:
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest.FromString(GOOD)
    request.inputs[0].contents.fp32_contents.extend([0.5] * H)
    return request.SerializeToString()


MALFORMED = {
    "input name not UTF-8": (GOOD.replace(b"hidden_states", b"hidden\xed\xa0\x80tes"), "parsed"),
    "model name not UTF-8": (GOOD.replace(TINY.encode(), b"t\xffny"), "parsed"),
    "not a message": (b"\xff\xff\xff", "parsed"),
    "shape [0, 2^63-1]": (_infer_message([0, (1 << 63) - 1]), "empty"),
    "shape [2^40, 2^40]": (_infer_message([1 << 40, 1 << 40]), "too large"),
    "typed and raw contents": (_typed_and_raw(), "not both"),
    "negative priority": (_infer_message([1, H], priority=("int64_param", -1)), ">= 0"),
    "timeout a double": (_infer_message([1, H], timeout=("double_param", 1e300)), ">= 0"),
    "timeout a string": (_infer_message([1, H], timeout=("string_param", "9" * 400)), ">= 0"),
}


@pytest.mark.parametrize(("message", "why"), MALFORMED.values(), ids=MALFORMED)
def test_grpc_malformed_requests_are_invalid_argument_never_internal(urls, message, why) -> None:
    grpc = grpcclient.grpc
    with grpc.insecure_channel(urls[1]) as channel, pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(message, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert why in err.value.details()


def test_grpc_schedule_policy_values_at_the_top_of_their_range_are_served(client) -> None:
    """priority and timeout arrive as 64-bit integers; the largest are a valid request."""
    from tritonclient.grpc import service_pb2 as pb

    most = ("uint64_param", (1 << 64) - 1)
    request = pb.ModelInferRequest.FromString(_infer_message([1, H], priority=most, timeout=most))
    response = client._client_stub.ModelInfer(request)
    assert np.frombuffer(response.raw_output_contents[0], np.float32).shape == (H,)


def test_grpc_rpcs_not_served_answer_unimplemented_without_an_error_logged(client, caplog):
    """A method of the service that moe-serve does not know is UNIMPLEMENTED, quietly."""
    channel = client._channel
    call = channel.unary_unary("/inference.GRPCInferenceService/NoSuchRpc")
    with pytest.raises(grpcclient.grpc.RpcError) as err:
        call(b"")
    assert err.value.code() == grpcclient.grpc.StatusCode.UNIMPLEMENTED
    assert err.value.details() == "moe-serve does not serve NoSuchRpc"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def _requests_counted(url: str, route: str, status: str) -> float:
    series = f'moe_serve_requests_total{{route="{route}",status="{status}"}} '
    line = next((x for x in httpx.get(url).text.splitlines() if x.startswith(series)), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


class _Logged(logging.Handler):
    """Each record's message and the request id it was logged under."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((logs.request_id.get(), record.getMessage()))


def test_grpc_calls_are_counted_and_logged_with_their_request_id(urls, client) -> None:
    """Each call (the RPC's handler made once, by its first call, and kept) is counted with its
    status in the request metric and logged under its x-request-id, once it is answered; an RPC
    moe-serve does not serve is counted UNIMPLEMENTED each time it is called."""
    metrics = f"{urls[0]}/metrics"
    series = [("grpc ModelInfer", "OK"), ("grpc NoSuchRpc", "UNIMPLEMENTED")]
    before = [_requests_counted(metrics, *s) for s in series]
    x = np.ones((1, H), np.float32)
    call = client._channel.unary_unary("/inference.GRPCInferenceService/NoSuchRpc")
    logger = logging.getLogger("moe_serve.service.grpc.interceptors")
    logged, level = _Logged(), logger.level
    logger.addHandler(logged)
    logger.setLevel(logging.INFO)
    try:
        for i in range(3):
            client.infer(TINY, [_input("hidden_states", x)], headers={"x-request-id": f"id-{i}"})
        for _ in range(2):
            with pytest.raises(grpcclient.grpc.RpcError):
                call(b"")
        # answered by the server's loop: after every call's bookkeeping
        after = [_requests_counted(metrics, *s) for s in series]
    finally:
        logger.removeHandler(logged)
        logger.setLevel(level)
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 2]
    for i in range(3):
        assert any(
            rid == f"id-{i}" and m.startswith("grpc ModelInfer -> OK in ")
            for rid, m in logged.lines
        )


def test_the_call_gate_makes_each_served_rpcs_handler_once() -> None:
    """The servicer's handler of an RPC is looked up, and wrapped, by its first call only; a
    name the service does not serve is answered each time, and nothing of it is kept."""
    from moe_serve.service.core.runtime import Runtime
    from moe_serve.service.grpc.interceptors import CallGate
    from moe_serve.service.metrics import Metrics

    looked_up = []

    async def continuation(details):
        looked_up.append(details.method)
        return grpcclient.grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    class Details:
        def __init__(self, method: str) -> None:
            self.method = method

    async def calls() -> list:
        gate = CallGate(Runtime(Settings(device="cpu"), Metrics()), {"ModelInfer"})
        return [
            await gate.intercept_service(continuation, Details(f"/{SERVICE}/{rpc}"))
            for rpc in ("ModelInfer", "ModelInfer", "NoSuchRpc", "NoSuchRpc")
        ] + [gate._handlers]

    infer, again, unknown, unknown_again, kept = asyncio.run(calls())
    assert looked_up == [f"/{SERVICE}/ModelInfer"]
    assert again is infer and infer.request_streaming and not infer.response_streaming
    assert unknown is not unknown_again and list(kept) == [f"/{SERVICE}/ModelInfer"]


def test_grpc_raw_contents_of_the_wrong_size_are_refused(client) -> None:
    tensor = grpcclient.InferInput("hidden_states", [2, H], "FP32")
    tensor.set_data_from_numpy(np.zeros((2, H), np.float32))
    tensor.set_shape([3, H])  # the bytes are for two rows
    with pytest.raises(grpcclient.InferenceServerException, match="for shape \\[3, 64\\]") as err:
        client.infer(TINY, [tensor])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_grpc_full_queue_is_resource_exhausted_and_drops_nothing(urls) -> None:
    """max_queue=2: of 16 concurrent requests some are refused; every answer is right."""
    import asyncio

    from tritonclient.grpc import aio

    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((2, H)).astype(np.float32) for _ in range(16)]

    async def main() -> list[np.ndarray | Exception]:
        async with aio.InferenceServerClient(urls[1]) as c:
            calls = [c.infer(TINY, [_input("hidden_states", x)]) for x in xs]
            results = await asyncio.gather(*calls, return_exceptions=True)
        return [r if isinstance(r, Exception) else r.as_numpy("output") for r in results]

    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and len(refused) < len(xs)
    for err in refused:
        assert err.status() == "StatusCode.RESOURCE_EXHAUSTED" and "max_queue=2" in str(err)
    for x, out in zip(xs, results, strict=True):
        if not isinstance(out, Exception):
            torch.testing.assert_close(torch.tensor(out), reference_forward(TINY, torch.tensor(x)))


def test_grpc_needs_the_bearer_token_when_one_is_set() -> None:
    port = free_port()
    app = create_app(Settings(device="cpu", grpc_port=port, api_token=TOKEN), tiny_loader)
    x = np.zeros((1, H), np.float32)
    with running_server(app) as url, grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as c:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        assert c.is_server_live() and c.is_server_ready()  # the probes are open
        with pytest.raises(grpcclient.InferenceServerException, match="bearer token") as err:
            c.infer(TINY, [_input("hidden_states", x)])
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(grpcclient.InferenceServerException) as err:
            c.get_model_metadata(TINY, headers={"authorization": "Bearer wrong-token-0123456789"})
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
        out = c.infer(
            TINY, [_input("hidden_states", x)], headers={"authorization": f"Bearer {TOKEN}"}
        ).as_numpy("output")
        assert out.shape == (1, H)


def test_grpc_port_in_use_stops_the_start_naming_the_address() -> None:
    import socket

    from moe_serve.service.core.runtime import Runtime
    from moe_serve.service.grpc.server import GrpcServer
    from moe_serve.service.metrics import Metrics

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        runtime = Runtime(Settings(device="cpu", grpc_port=port), Metrics())

        async def start() -> None:
            await GrpcServer(runtime).start()

        with pytest.raises(OSError, match=f"gRPC cannot listen on 127.0.0.1:{port}"):
            asyncio.run(start())
