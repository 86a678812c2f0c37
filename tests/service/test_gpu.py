"""The service on a GPU with the demo layers: a GPU backend is chosen, /backends shows the
device, and forwards over HTTP match the reference backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from fastapi.testclient import TestClient

from moe_serve.kernels.accuracy import BY_DTYPE, SERVED_FP8_LAYER, relative_error
from moe_serve.kernels.arith import round_up
from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.layer_graphs import token_buckets
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.codecs import json_device
from moe_serve.service.engine.engine import Engine
from moe_serve.service.frontends.arena import BLOCK_BYTES, REPLY_HEADER_BYTES
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from moe_serve.weights.load import load_layer
from tests.service.conftest import wait_ready
from tests.service.layers import running_server
from tests.service.test_copy_memory import given_back

pytestmark = pytest.mark.gpu

GPU_READY_TIMEOUT_S = 300.0  # warm-up compiles every tile bucket up to max_batch_tokens
TOLERANCE = {"demo": BY_DTYPE[torch.bfloat16], "demo-fp8": SERVED_FP8_LAYER}


@pytest.fixture(scope="module")
def gpu_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path]]:
    cache = tmp_path_factory.mktemp("cache")
    with TestClient(create_app(Settings(device="cuda", cache_dir=cache))) as client:
        wait_ready(client.get, GPU_READY_TIMEOUT_S)
        yield client, cache


def test_backends_shows_the_gpu_and_a_gpu_backend_per_layer(gpu_client) -> None:
    client, _ = gpu_client
    backends = client.get("/backends").json()
    assert backends["device"]["type"] == "cuda"
    assert backends["device"]["memory_bytes"] > 0
    assert backends["device"]["compute_capability"]
    for layer in backends["layers"]:
        assert layer["experts"] not in ("reference", "reference-batched"), layer


@pytest.mark.parametrize("tokens", [1, 64, 300], ids=lambda t: f"M={t}")
def test_demo_layers_on_gpu_match_the_reference(gpu_client, tokens: int) -> None:
    client, cache = gpu_client
    for layer in client.get("/backends").json()["layers"]:
        name = layer["layer"]
        loaded = load_layer(cache / name, torch.device("cpu"))
        cpu = torch.device("cpu")
        reference, _ = build_layer(loaded.config, loaded.weights, cpu, "reference")
        hidden = torch.randn(tokens, loaded.config.hidden_size).bfloat16()
        r = client.post(
            f"/v1/layers/{name}/forward",
            content=safetensors.torch.save({"hidden_states": hidden}),
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text
        out = safetensors.torch.load(r.content)["output"]
        error = relative_error(out, reference.forward(ForwardInputs(hidden)).output)
        assert error < TOLERANCE[name], f"{name} on {layer['experts']}: {error:.2e}"


def test_demo_layers_on_gpu_run_from_cuda_graphs_of_every_bucket(gpu_client) -> None:
    client, _ = gpu_client
    for layer in client.get("/backends").json()["layers"]:
        assert layer["graph_buckets"] == list(token_buckets(1024)), layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_requests_of_another_wire_dtype_are_cast_once_and_answered_in_theirs(
    gpu_client, dtype: torch.dtype
) -> None:
    client, cache = gpu_client
    loaded = load_layer(cache / "demo", torch.device("cpu"))
    reference, _ = build_layer(loaded.config, loaded.weights, torch.device("cpu"), "reference")
    hidden = torch.randn(17, loaded.config.hidden_size).bfloat16().to(dtype)  # bf16-exact
    r = client.post(
        "/v1/layers/demo/forward?return_routing=true",
        content=safetensors.torch.save({"hidden_states": hidden}),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    reply = safetensors.torch.load(r.content)
    assert reply["output"].dtype == dtype
    expected = reference.forward(ForwardInputs(hidden.bfloat16()))
    assert relative_error(reply["output"], expected.output) < TOLERANCE["demo"]
    assert reply["topk_ids"].shape == (17, 2)


def test_concurrent_requests_on_gpu_each_get_their_own_rows(gpu_client) -> None:
    """Batched, pipelined (several batches in flight) and padded to graph buckets: every request
    still gets exactly its rows."""
    import concurrent.futures

    client, cache = gpu_client
    loaded = load_layer(cache / "demo", torch.device("cpu"))
    reference, _ = build_layer(loaded.config, loaded.weights, torch.device("cpu"), "reference")
    inputs = [torch.randn(t, loaded.config.hidden_size).bfloat16() for t in (1, 5, 64, 3, 200, 2)]

    def post(hidden: torch.Tensor) -> torch.Tensor:
        r = client.post(
            "/v1/layers/demo/forward",
            content=safetensors.torch.save({"hidden_states": hidden}),
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text
        return safetensors.torch.load(r.content)["output"]

    with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
        outputs = list(pool.map(post, inputs * 3))
    for hidden, out in zip(inputs * 3, outputs, strict=True):
        expected = reference.forward(ForwardInputs(hidden)).output
        assert relative_error(out, expected) < TOLERANCE["demo"]


def test_an_output_that_overflows_on_the_gpu_answers_422_and_the_layer_still_serves(
    gpu_client,
) -> None:
    """1e30 fits bfloat16, but the experts' products do not: the device-side check catches it."""
    client, _ = gpu_client
    hidden = torch.randn(4, 256).bfloat16()
    hidden[3, 0] = 1e30
    r = client.post(
        "/v1/layers/demo/forward",
        content=safetensors.torch.save({"hidden_states": hidden}),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 422, r.text
    assert "holds NaN or Inf at row 3 of this request" in r.json()["error"]
    assert 'moe_serve_nonfinite_forwards_total{layer="demo"}' in client.get("/metrics").text
    ok = client.post("/v1/layers/demo/forward", json={"hidden_states": [[0.01] * 256]})
    assert ok.status_code == 200


@pytest.mark.parametrize("layer", ["demo", "demo-fp8"])
def test_a_float16_reply_beyond_float16_answers_422_on_the_gpu(gpu_client, layer: str) -> None:
    """The bfloat16 layers' output of large float16 inputs fits bfloat16 but not float16: the
    cast to the request's dtype is checked, and the counter moves."""
    client, _ = gpu_client
    series = f'moe_serve_nonfinite_forwards_total{{layer="{layer}"}}'

    def count() -> float:
        lines = client.get("/metrics").text.splitlines()
        return next((float(x.split()[-1]) for x in lines if x.startswith(series + " ")), 0.0)

    before = count()
    hidden = torch.randn(4, 256).half()
    hidden[1:] = 6e4
    r = client.post(
        f"/v1/layers/{layer}/forward",
        content=safetensors.torch.save({"hidden_states": hidden}),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 422, r.text
    assert "exceeds float16" in r.json()["error"]
    assert count() == before + 1
    ok = client.post(
        f"/v1/layers/{layer}/forward",
        content=safetensors.torch.save({"hidden_states": hidden[:1]}),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert ok.status_code == 200, ok.text
    assert safetensors.torch.load(ok.content)["output"].isfinite().all()


@pytest.mark.parametrize("tensor", ["hidden_states", "router_logits"])
def test_a_nonfinite_input_on_the_gpu_answers_400_naming_it_and_the_layer_still_serves(
    gpu_client, tensor: str
) -> None:
    """Values are checked on the device with the batch (the graph's input flag for hidden states
    alone; the eager forward's with client logits): the request gets the 400 naming its value."""
    client, _ = gpu_client
    hidden = torch.randn(5, 256).bfloat16()
    tensors = {"hidden_states": hidden, "router_logits": torch.randn(5, 8)}
    tensors[tensor][3, 2] = float("inf")
    r = client.post(
        "/v1/layers/demo/forward",
        content=safetensors.torch.save(tensors),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"] == f"{tensor} holds NaN or Inf (first at row 3, column 2)"
    fine = torch.randn(3, 256).bfloat16()
    ok = client.post(
        "/v1/layers/demo/forward",
        content=safetensors.torch.save({"hidden_states": fine}),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert ok.status_code == 200, ok.text


def test_a_backend_captured_up_to_its_limit_runs_larger_batches_eagerly(gpu_client) -> None:
    """triton-batched syncs with the host above 256 tokens: its graphs stop there, and a larger
    batch runs eagerly from the same slots, equal to the reference either side."""
    _, cache = gpu_client
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    engine = Engine([cuda], backend="triton-batched", chunk_tokens=320)
    served = engine.add(load_layer(cache / "demo", cuda))
    assert served.graphs is not None and served.graphs.max_tokens == 256
    engine.warm_up([1])
    loaded = load_layer(cache / "demo", cpu)
    reference, _ = build_layer(loaded.config, loaded.weights, cpu, "reference")
    for tokens in (3, 256, 300):
        hidden = torch.randn(tokens, loaded.config.hidden_size).bfloat16()
        out = engine.start("demo", [ForwardInputs(hidden)]).result().outputs[0].output
        expected = reference.forward(ForwardInputs(hidden)).output
        assert relative_error(out, expected) < TOLERANCE["demo"], tokens


def test_small_and_large_parts_of_one_batch_each_get_their_rows(gpu_client) -> None:
    """Small pinned parts go through the slot's buffers, large ones straight to and from the
    device, pageable ones are staged: in one batch each part's output (into its own buffer
    where it gave one) matches the same rows run alone."""
    _, cache = gpu_client
    cuda = torch.device("cuda")
    engine = Engine([cuda], chunk_tokens=1024)
    engine.add(load_layer(cache / "demo", cuda))
    engine.warm_up([1])
    sizes = [3, 600, 5, 2]  # 600 rows of bf16 H=256: over the in-place threshold
    hidden = [torch.randn(t, 256).bfloat16() for t in sizes]
    parts = [h.pin_memory() if i < 3 else h for i, h in enumerate(hidden)]
    into = [torch.empty_like(h).pin_memory() if i in (0, 1) else None for i, h in enumerate(hidden)]
    result = engine.start("demo", [ForwardInputs(p) for p in parts], into).result()
    for i, (h, out) in enumerate(zip(hidden, result.outputs, strict=True)):
        alone = engine.start("demo", [ForwardInputs(h)]).result().outputs[0].output
        assert relative_error(out.output, alone) < TOLERANCE["demo"], i  # tiles differ by M
        if into[i] is not None:
            assert out.output.data_ptr() == into[i].data_ptr(), i


def test_large_binary_bodies_read_into_pinned_memory_by_a_real_server_match_the_reference(
    gpu_client,
) -> None:
    """One process on a GPU: the connection reads a body of 256 KiB or more straight into
    pinned memory (service/http/direct_body.py) and the reply is written after it from the
    device."""
    _, cache = gpu_client
    loaded = load_layer(cache / "demo", torch.device("cpu"))
    reference, _ = build_layer(loaded.config, loaded.weights, torch.device("cpu"), "reference")
    app = create_app(Settings(device="cuda", cache_dir=cache, max_batch_tokens=1024))
    sink, taken = app.state.body_sink, []

    def counting_sink(scope, size):  # a BodySink
        target = sink(scope, size)
        taken.append(target is not None)
        return target

    app.state.body_sink = counting_sink
    inputs = [torch.randn(t, loaded.config.hidden_size).bfloat16() for t in (600, 3, 1000, 600)]
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        wait_ready(http.get, GPU_READY_TIMEOUT_S)
        for hidden in inputs:
            r = http.post(
                "/v1/layers/demo/forward",
                content=safetensors.torch.save({"hidden_states": hidden}),
                headers={"Content-Type": "application/octet-stream"},
            )
            assert r.status_code == 200, r.text
            out = safetensors.torch.load(r.content)["output"]
            expected = reference.forward(ForwardInputs(hidden)).output
            assert relative_error(out, expected) < TOLERANCE["demo"]
        bad = inputs[0].clone()
        bad[7, 11] = float("nan")
        r = http.post(
            "/v1/layers/demo/forward",
            content=safetensors.torch.save({"hidden_states": bad}),
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"] == "hidden_states holds NaN or Inf (first at row 7, column 11)"
    assert taken == [True, False, True, True, True]  # 3 rows: under PINNED_BODY_MIN


def test_large_json_bodies_read_into_pinned_memory_by_a_real_server_answer_as_binary_ones(
    gpu_client,
) -> None:
    """One process on a GPU: the connection reads a JSON body the device parses straight into
    pinned memory, from which it is copied to the device; the output is the binary forward's. A
    small JSON body is read as bytes, and a large one the device does not read gets the host
    path's 400."""
    _, cache = gpu_client
    app = create_app(Settings(device="cuda", cache_dir=cache, max_batch_tokens=1024))
    sink, taken = app.state.body_sink, []

    def counting_sink(scope, size):  # a BodySink
        target = sink(scope, size)
        taken.append(target is not None)
        return target

    app.state.body_sink = counting_sink
    as_json = {"Content-Type": "application/json"}
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        wait_ready(http.get, GPU_READY_TIMEOUT_S)
        for tokens in (300, 3):
            hidden = torch.randn(tokens, 256).bfloat16()
            binary = http.post(
                "/v1/layers/demo/forward",
                content=safetensors.torch.save({"hidden_states": hidden}),
                headers={"Content-Type": "application/octet-stream"},
            )
            body = json.dumps({"hidden_states": hidden.float().tolist()})
            assert json_device.worth_it(len(body)) == (tokens == 300)
            r = http.post("/v1/layers/demo/forward", content=body, headers=as_json)
            assert r.status_code == 200, r.text
            expected = safetensors.torch.load(binary.content)["output"].float()
            assert torch.equal(torch.tensor(r.json()["output"]), expected)
        body = json.dumps({"hidden_states": torch.randn(300, 256).tolist()})
        r = http.post("/v1/layers/demo/forward", content="[" + body[1:], headers=as_json)
        assert r.status_code == 400, r.text
        assert "body is not valid JSON" in r.json()["error"]
    # binary bodies of 300 and 3 rows are under PINNED_BODY_MIN
    assert taken == [False, True, False, False, True]


def test_pinned_bodies_and_replies_come_from_copy_memory_and_go_back(gpu_client) -> None:
    """One process on a GPU: a large body and its reply lie in a block of copy memory, pinned
    once, which each repeat of the request gets back; torch's pinned allocator makes no block
    per request (its cache's new blocks are page-locked allocations of milliseconds)."""
    _, cache = gpu_client
    app = create_app(Settings(device="cuda", cache_dir=cache, max_batch_tokens=1024))
    memory = app.state.runtime.shared_memory.copy_memory
    hidden = torch.randn(600, 256).bfloat16()
    bodies = [
        (safetensors.torch.save({"hidden_states": hidden}), "application/octet-stream"),
        (json.dumps({"hidden_states": hidden.float().tolist()}).encode(), "application/json"),
    ]
    idle = 0
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        wait_ready(http.get, GPU_READY_TIMEOUT_S)
        for body, media in bodies:
            headers = {"Content-Type": media}
            room = round_up(len(body), BLOCK_BYTES)
            idle += 1 << (room + len(body) + REPLY_HEADER_BYTES - 1).bit_length()
            replies = []
            for i in range(4):
                r = http.post("/v1/layers/demo/forward", content=body, headers=headers)
                assert r.status_code == 200, r.text
                replies.append(r.content)
                assert given_back(memory, idle), (memory.idle_bytes, idle)
                if i == 0:
                    allocated = torch.cuda.host_memory_stats()["num_host_alloc"]
            assert torch.cuda.host_memory_stats()["num_host_alloc"] == allocated
            assert replies.count(replies[0]) == len(replies)


def test_large_json_forwards_are_parsed_and_printed_on_the_gpu_as_the_host_would(
    gpu_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """service/codecs/json_device.py serves large JSON bodies: the reply is the one the
    binary forward gets; what it does not read gets the host path's 400."""
    client, _ = gpu_client
    calls = {"parsed": 0, "printed": 0}
    parse, print_reply = json_device.decode_forward, json_device.print_reply

    def counted(key, fn):
        def run(*args):
            calls[key] += 1
            return fn(*args)

        return run

    monkeypatch.setattr(json_device, "decode_forward", counted("parsed", parse))
    monkeypatch.setattr(json_device, "print_reply", counted("printed", print_reply))
    for tokens in (200, 300):
        hidden = torch.randn(tokens, 256).bfloat16()
        binary = client.post(
            "/v1/layers/demo/forward",
            content=safetensors.torch.save({"hidden_states": hidden}),
            headers={"Content-Type": "application/octet-stream"},
        )
        body = json.dumps({"hidden_states": hidden.float().tolist(), "return_routing": True})
        assert json_device.worth_it(len(body))
        r = client.post(
            "/v1/layers/demo/forward",
            content=body,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 200, r.text
        expected = safetensors.torch.load(binary.content)["output"].float()
        assert torch.equal(torch.tensor(r.json()["output"]), expected)
        assert len(r.json()["topk_ids"]) == tokens
    assert calls == {"parsed": 2, "printed": 2}
    rows = torch.randn(200, 256).tolist()
    rows[0][1], rows[2][3] = 1e39, 12345.0
    text = json.dumps({"hidden_states": rows})
    for broken, error in (
        (text.replace("12345.0", "012345.0"), "body is not valid JSON"),
        (text, "hidden_states[0][1] is 1e+39, beyond float32's range (±3.4028235e+38)"),
    ):
        r = client.post(
            "/v1/layers/demo/forward",
            content=broken,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400, r.text
        assert error in r.json()["error"]


def test_the_gpu_metrics_come_from_nvml_for_the_gpu_served_on(gpu_client) -> None:
    """nv_gpu_* from the real NVML: the total memory is the device's, the used memory holds
    at least what this process allocated, labelled by the GPU's UUID."""
    from prometheus_client.parser import text_string_to_metric_families

    pytest.importorskip("pynvml", reason="nvidia-ml-py is a dependency; install it")
    client, _ = gpu_client
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    total = families["nv_gpu_memory_total_bytes"].samples
    used = families["nv_gpu_memory_used_bytes"].samples
    assert total and all(s.labels["gpu_uuid"].startswith("GPU-") for s in total)
    device_total = torch.cuda.get_device_properties(0).total_memory
    assert any(abs(s.value - device_total) <= 0.05 * device_total for s in total)
    assert max(s.value for s in used) >= torch.cuda.memory_reserved(0)
    assert "nv_gpu_utilization" in families and "nv_gpu_power_usage" in families
