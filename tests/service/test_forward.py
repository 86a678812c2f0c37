"""POST /v1/layers/{name}/forward: JSON and safetensors bodies, against the reference layer,
and every kind of bad input answered with a 4xx that names the problem."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from fastapi.testclient import TestClient

from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.layer import LayerWeights, RouterWeights
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.routing import route
from moe_serve.service.codecs import json_numbers
from moe_serve.service.http.app import create_app
from moe_serve.service.off_loop import JSON
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import NO_ROUTER, TINY, TOP_K, E, H, TinyLayer, reference_forward

BINARY = {"Content-Type": "application/octet-stream"}
JSON_TYPE = "application/json"
URL = f"/v1/layers/{TINY}/forward"


def hidden(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))


def post_blob(client: TestClient, url: str = URL, **tensors: torch.Tensor):
    return client.post(url, content=safetensors.torch.save(tensors), headers=BINARY)


@pytest.mark.parametrize("tokens", [1, 5, 37], ids=lambda t: f"M={t}")
def test_json_forward_matches_the_reference_layer(client: TestClient, tokens: int) -> None:
    x = hidden(tokens)
    r = client.post(URL, json={"hidden_states": x.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["layer"], body["tokens"], body["backend"]) == (TINY, tokens, "reference")
    torch.testing.assert_close(torch.tensor(body["output"]), reference_forward(TINY, x))
    assert "topk_ids" not in body


def test_json_forward_routes_by_the_given_logits_and_returns_routing(client: TestClient) -> None:
    x = hidden(6)
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(1))
    r = client.post(
        URL,
        json={
            "hidden_states": x.tolist(),
            "router_logits": logits.tolist(),
            "return_routing": True,
        },
    )
    assert r.status_code == 200, r.text
    expected = route(logits, RoutingConfig(top_k=TOP_K))
    body = r.json()
    assert torch.equal(torch.tensor(body["topk_ids"], dtype=torch.int32), expected.topk_ids)
    torch.testing.assert_close(torch.tensor(body["topk_weights"]), expected.topk_weights)
    torch.testing.assert_close(torch.tensor(body["output"]), reference_forward(TINY, x, logits))


@pytest.mark.parametrize(
    ("limit_at", "over", "threaded"),
    [
        ("body", 0, {"_encode_json"}),  # the body at the limit: decoded on the event loop
        ("body", 1, {"_decode_json", "_encode_json"}),  # a byte over: on a JSON thread
        ("reply", 0, set()),  # the reply's JSON at the limit: written on the event loop
        ("reply", 1, {"_encode_json"}),
    ],
    ids=["body at the limit", "body over it", "reply at the limit", "reply over it"],
)
def test_json_work_on_either_side_of_the_on_loop_limit_gets_the_same_reply(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, limit_at: str, over: int, threaded: set
) -> None:
    # numbers of a few bytes: the body is smaller than the reply is taken to be
    x = (torch.randint(-8, 8, (5, H), generator=torch.Generator().manual_seed(0)) / 4).tolist()
    body = json.dumps({"hidden_states": x}).encode()
    sizes = {"body": len(body), "reply": 5 * H * json_numbers.NUMBER_BYTES}
    assert sizes["body"] < sizes["reply"] - 1
    expected = client.post(URL, content=body, headers={"Content-Type": JSON_TYPE})
    ran, off_loop = set(), JSON.off_loop

    async def spy(fn, *args):
        ran.add(fn.__name__)
        return await off_loop(fn, *args)

    monkeypatch.setattr(JSON, "off_loop", spy)
    monkeypatch.setattr(JSON, "on_loop_bytes", sizes[limit_at] - over)
    r = client.post(URL, content=body, headers={"Content-Type": JSON_TYPE})
    assert (r.status_code, expected.status_code) == (200, 200), r.text
    assert r.content == expected.content
    assert ran == threaded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_binary_forward_answers_in_the_input_dtype(client: TestClient, dtype: torch.dtype) -> None:
    x = hidden(9).to(dtype)
    r = post_blob(client, hidden_states=x)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    out = safetensors.torch.load(r.content)["output"]
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference_forward(TINY, x).to(dtype))


def test_binary_forward_returns_routing_when_asked(client: TestClient) -> None:
    x = hidden(4)
    logits = torch.randn(4, E)
    r = client.post(
        URL + "?return_routing=true",
        content=safetensors.torch.save({"hidden_states": x, "router_logits": logits}),
        headers=BINARY,
    )
    blob = safetensors.torch.load(r.content)
    assert torch.equal(blob["topk_ids"], route(logits, RoutingConfig(top_k=TOP_K)).topk_ids)


def test_layer_without_router_runs_on_client_logits(client: TestClient) -> None:
    x, logits = hidden(3), torch.randn(3, E)
    r = post_blob(client, f"/v1/layers/{NO_ROUTER}/forward", hidden_states=x, router_logits=logits)
    assert r.status_code == 200, r.text
    out = safetensors.torch.load(r.content)["output"]
    torch.testing.assert_close(out, reference_forward(NO_ROUTER, x, logits))


def test_request_larger_than_the_batch_limit_is_chunked_not_refused(make_client) -> None:
    client = make_client(max_batch_tokens=8)
    x = hidden(29)
    r = post_blob(client, hidden_states=x)
    assert r.status_code == 200, r.text
    torch.testing.assert_close(
        safetensors.torch.load(r.content)["output"], reference_forward(TINY, x)
    )


def test_all_tokens_on_one_expert_match_the_reference(client: TestClient) -> None:
    x = hidden(7)
    logits = torch.full((7, E), -5.0)
    logits[:, 2] = 5.0  # expert 2 first for every token; expert 3 never chosen (ties: lower id)
    r = post_blob(client, hidden_states=x, router_logits=logits)
    torch.testing.assert_close(
        safetensors.torch.load(r.content)["output"], reference_forward(TINY, x, logits)
    )


# ---- bad input: 4xx naming the problem --------------------------------------------------------

NAN = hidden(2)
NAN[1, 3] = float("nan")
INF = hidden(2)
INF[0, 5] = float("inf")

BAD_BLOBS = {
    "wrong hidden size": ({"hidden_states": torch.zeros(2, H + 1)}, "hidden_size is 64"),
    "wrong expert count": (
        {"hidden_states": hidden(2), "router_logits": torch.zeros(2, E + 1)},
        "router_logits has 5 columns",
    ),
    "logits for other tokens": (
        {"hidden_states": hidden(2), "router_logits": torch.zeros(3, E)},
        "router_logits has 3 tokens but hidden_states has 2",
    ),
    "1-D hidden states": ({"hidden_states": torch.zeros(H)}, "hidden_states must be 2-D"),
    "no tokens": ({"hidden_states": torch.zeros(0, H)}, "hidden_states is empty"),
    "NaN": ({"hidden_states": NAN}, "hidden_states holds NaN or Inf (first at row 1, column 3)"),
    "Inf": ({"hidden_states": INF}, "hidden_states holds NaN or Inf (first at row 0, column 5)"),
    "float64": ({"hidden_states": hidden(2).double()}, "hidden_states has dtype torch.float64"),
    "int32": ({"hidden_states": torch.zeros(2, H, dtype=torch.int32)}, "dtype torch.int32"),
    "unknown tensor": ({"hidden_states": hidden(1), "extra": torch.zeros(1)}, "blob: extra;"),
    "missing hidden states": ({"router_logits": torch.zeros(1, E)}, "no hidden_states"),
}


@pytest.mark.parametrize("case", BAD_BLOBS, ids=str)
def test_bad_blob_returns_400_naming_the_problem(client: TestClient, case: str) -> None:
    tensors, message = BAD_BLOBS[case]
    r = post_blob(client, **tensors)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]


BAD_JSON = {
    "ragged": ({"hidden_states": [[0.0] * H, [0.0] * 3]}, 400, "hidden_states is ragged"),
    "empty": ({"hidden_states": []}, 400, "hidden_states is empty"),
    "empty row": ({"hidden_states": [[]]}, 400, "hidden_states is empty"),
    "wrong hidden size": ({"hidden_states": [[0.0] * 3]}, 400, "hidden_size is 64"),
    "not numbers": ({"hidden_states": [["a"] * H]}, 400, 'hidden_states[0][0] is "a"; expected'),
    "true for 1.0": (
        {"hidden_states": [[0.5] * 7 + [True] + [0.5] * (H - 8)]},
        400,
        "hidden_states[0][7] is true; expected a number",
    ),
    "a string number": (
        {"hidden_states": [[0.0] * H, ["0.5"] * H]},
        400,
        'hidden_states[1][0] is "0.5"',
    ),
    "yes for true": (
        {"hidden_states": [[0.0] * H], "return_routing": "yes"},
        400,
        'return_routing must be true or false, got "yes"',
    ),
    "not an object": ([[0.0] * H], 400, "body must be a JSON object with hidden_states"),
    "missing field": ({"router_logits": [[0.0] * E]}, 400, "hidden_states is missing"),
    "unknown field": ({"hidden_states": [[0.0] * H], "hiden": 1}, 400, "hiden"),
    "ragged logits": (
        {"hidden_states": [[0.0] * H] * 2, "router_logits": [[0.0] * E, [0.0]]},
        400,
        "router_logits is ragged",
    ),
}


@pytest.mark.parametrize("case", BAD_JSON, ids=str)
def test_bad_json_returns_4xx_naming_the_problem(client: TestClient, case: str) -> None:
    body, status, message = BAD_JSON[case]
    r = client.post(URL, json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]


@pytest.mark.parametrize("case", BAD_JSON, ids=str)
def test_bad_json_decoded_on_a_json_thread_gets_the_same_4xx(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    monkeypatch.setattr(JSON, "on_loop_bytes", 0)  # every body goes to a thread
    body, status, message = BAD_JSON[case]
    r = client.post(URL, json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]


@pytest.mark.parametrize(
    ("number", "message"),
    [
        ("NaN", "body is not valid JSON: unexpected character"),
        ("Infinity", "body is not valid JSON: unexpected character"),
        ("1e400", "body holds 1e400 at line 1 column "),
    ],
)
def test_a_non_finite_json_number_returns_400(client: TestClient, number, message) -> None:
    row = ", ".join(["0.0"] * (H - 1) + [number])
    r = client.post(
        URL, content=f'{{"hidden_states": [[{row}]]}}', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["error"].startswith(message)


def test_malformed_json_returns_400(client: TestClient) -> None:
    r = client.post(
        URL, content=b'{"hidden_states": [[1,', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]


def test_corrupt_safetensors_blob_returns_400(client: TestClient) -> None:
    blob = safetensors.torch.save({"hidden_states": hidden(2)})
    r = client.post(URL, content=blob[:40], headers=BINARY)
    assert r.status_code == 400
    assert "not a valid safetensors blob" in r.json()["error"]


def test_unknown_content_type_returns_415(client: TestClient) -> None:
    r = client.post(URL, content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert "'text/plain'" in r.json()["error"]


def test_body_over_the_size_limit_returns_413(make_client) -> None:
    client = make_client(max_body_bytes=4096)
    r = post_blob(client, hidden_states=hidden(64))
    assert r.status_code == 413
    assert "4096-byte limit" in r.json()["error"]


def test_unknown_layer_returns_404_listing_the_served_ones(client: TestClient) -> None:
    r = post_blob(client, "/v1/layers/nope/forward", hidden_states=hidden(1))
    assert r.status_code == 404
    assert r.json()["error"] == f"no layer named 'nope'; served layers: {TINY}, {NO_ROUTER}"


def test_layer_without_router_refuses_requests_without_logits(client: TestClient) -> None:
    r = post_blob(client, f"/v1/layers/{NO_ROUTER}/forward", hidden_states=hidden(1))
    assert r.status_code == 400
    assert "no stored router: send router_logits" in r.json()["error"]


def test_failing_forward_returns_500_and_the_next_request_succeeds(
    client: TestClient, monkeypatch
) -> None:
    engine = client.app.state.runtime.engine
    real = engine.forward
    calls = []

    def fail_once(name, inputs):
        calls.append(name)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access")
        return real(name, inputs)

    monkeypatch.setattr(engine, "forward", fail_once)
    r = post_blob(client, hidden_states=hidden(2))
    assert r.status_code == 500
    assert "forward of layer 'tiny' failed: RuntimeError: CUDA error" in r.json()["error"]
    assert post_blob(client, hidden_states=hidden(2)).status_code == 200


def test_gzipped_body_is_inflated(client: TestClient) -> None:
    x = hidden(3)
    body = gzip.compress(safetensors.torch.save({"hidden_states": x}))
    r = client.post(URL, content=body, headers={**BINARY, "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    torch.testing.assert_close(
        safetensors.torch.load(r.content)["output"], reference_forward(TINY, x)
    )


JSON_LIMIT_HINT = "(MOE_SERVE_MAX_JSON_BYTES); send larger requests in binary"


def test_json_body_over_the_json_limit_returns_413_pointing_to_binary(make_client) -> None:
    client = make_client(max_json_bytes=4096)
    body = {"hidden_states": [[0.125] * H] * 20}  # about 14 kB
    r = client.post(URL, json=body)
    assert r.status_code == 413
    assert r.json()["error"].startswith("request body of ")
    assert JSON_LIMIT_HINT in r.json()["error"]
    streamed = client.post(  # no Content-Length: the limit is found while reading
        URL, content=iter([json.dumps(body).encode()]), headers={"Content-Type": JSON_TYPE}
    )
    assert streamed.status_code == 413
    assert JSON_LIMIT_HINT in streamed.json()["error"]
    same_rows = post_blob(client, hidden_states=torch.tensor(body["hidden_states"]))
    assert same_rows.status_code == 200  # binary bodies have the general limit only


def test_gzipped_json_inflating_past_the_json_limit_returns_413(make_client) -> None:
    client = make_client(max_json_bytes=4096)
    body = gzip.compress(json.dumps({"hidden_states": [[0.125] * H] * 20}).encode())
    r = client.post(
        URL, content=body, headers={"Content-Type": JSON_TYPE, "Content-Encoding": "gzip"}
    )
    assert r.status_code == 413
    assert r.json()["error"].startswith("request body inflates past the 4096-byte limit of a JSON")


def test_body_that_inflates_past_the_limit_returns_413(make_client) -> None:
    client = make_client(max_body_bytes=4096)
    bomb = gzip.compress(bytes(1 << 20))  # 1 MiB of zeros in about 1 kB
    r = client.post(URL, content=bomb, headers={**BINARY, "Content-Encoding": "gzip"})
    assert r.status_code == 413
    assert "inflates past the 4096-byte limit" in r.json()["error"]


def test_truncated_gzip_body_is_reported_as_truncated(client: TestClient) -> None:
    body = gzip.compress(safetensors.torch.save({"hidden_states": hidden(3)}))
    r = client.post(URL, content=body[:-20], headers={**BINARY, "Content-Encoding": "gzip"})
    assert r.status_code == 400
    assert r.json()["error"] == "body is truncated gzip data: the compressed stream ends early"


def test_a_blob_of_100k_unknown_tensors_gets_a_short_error(client: TestClient) -> None:
    # safetensors.numpy writes the bytes safetensors.torch does, without its per-tensor checks
    tensors = {f"t{i:06d}": np.zeros(1, np.float32) for i in range(100_000)}
    tensors["hidden_states"] = hidden(1).numpy()
    r = client.post(URL, content=safetensors.numpy.save(tensors), headers=BINARY)
    assert r.status_code == 400
    assert r.json()["error"] == (
        "unknown tensors in the blob: t000000, t000001, t000002 and 99997 more; "
        "expected ['hidden_states', 'router_logits']"
    )


@pytest.mark.parametrize(
    ("encoding", "status", "message"),
    [("br", 415, "content encoding 'br' is not accepted"), ("gzip", 400, "not valid gzip data")],
)
def test_bad_content_encoding_is_refused(client, encoding: str, status: int, message: str) -> None:
    r = client.post(URL, content=b"plain", headers={**BINARY, "Content-Encoding": encoding})
    assert r.status_code == status
    assert message in r.json()["error"]


def test_device_fault_turns_ready_and_every_request_into_503(
    client: TestClient, monkeypatch
) -> None:
    layer = client.app.state.runtime.engine.get(TINY).layer

    def fault(inputs):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(layer, "forward", fault)
    r = post_blob(client, hidden_states=hidden(2))
    assert r.status_code == 503
    assert (
        r.json()["error"]
        == "the device failed: CUDA error: an illegal memory access was encountered"
    )
    assert client.get("/ready").json()["reason"].startswith("the device failed: CUDA error")
    assert (
        post_blob(
            client,
            f"/v1/layers/{NO_ROUTER}/forward",
            hidden_states=hidden(1),
            router_logits=torch.zeros(1, E),
        ).status_code
        == 503
    )
    assert client.get("/health").status_code == 200


def test_a_forward_whose_output_overflows_answers_422_naming_the_layer_and_is_counted(
    client: TestClient,
) -> None:
    x = hidden(2)
    x[1, 3] = 1e30  # float32 holds it; the experts' products do not
    r = post_blob(client, hidden_states=x)
    assert r.status_code == 422
    assert r.json()["error"].startswith(f"the output of layer '{TINY}' holds NaN or Inf at row 1")
    metrics = client.get("/metrics").text
    assert f'moe_serve_nonfinite_forwards_total{{layer="{TINY}"}} 1.0' in metrics
    assert post_blob(client, hidden_states=hidden(2)).status_code == 200  # the layer still serves


@pytest.mark.parametrize("body", ["{0}", "[[0.5], {0}]"], ids=["all deep", "one row deep"])
def test_json_nested_a_thousand_deep_is_400_naming_the_depth(client: TestClient, body: str) -> None:
    deep = "[" * 1000 + "1" + "]" * 1000
    r = client.post(
        URL,
        content='{"hidden_states": ' + body.format(deep) + "}",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"] == "hidden_states is nested more than 32 arrays deep"


def test_a_float16_reply_that_would_hold_inf_answers_422_and_is_counted(
    client: TestClient,
) -> None:
    """The float32 layer's output of large float16 inputs exceeds float16: the cast back to the
    request's dtype would serve Inf."""
    x = hidden(3).half()
    x[2] = 6e4
    r = post_blob(client, hidden_states=x)
    assert r.status_code == 422
    assert r.json()["error"].startswith(f"the output of layer '{TINY}' holds NaN or Inf at row 2")
    assert "exceeds float16 (largest 65504)" in r.json()["error"]
    metrics = client.get("/metrics").text
    assert f'moe_serve_nonfinite_forwards_total{{layer="{TINY}"}} 1.0' in metrics
    r = post_blob(client, hidden_states=x[:2])
    assert r.status_code == 200
    out = safetensors.torch.load(r.content)["output"]
    assert out.dtype == torch.float16 and out.isfinite().all()


def test_a_value_beyond_the_layers_dtype_is_refused_naming_row_and_column() -> None:
    cfg = MoEConfig(E, H, 2 * H, RoutingConfig(top_k=TOP_K), dtype=torch.float16)
    layer = TinyLayer("half", cfg, LayerWeights(random_expert_weights(cfg), RouterWeights()))
    app = create_app(Settings(device="cpu"), lambda settings, devices: [layer])
    with TestClient(app) as half:
        wait_ready(half.get)
        x = hidden(3)
        x[2, 9] = 1e5  # float16 ends at 65504
        logits = torch.zeros(3, E)
        r = post_blob(half, "/v1/layers/half/forward", hidden_states=x, router_logits=logits)
    assert r.status_code == 400
    assert r.json()["error"] == (
        "hidden_states holds 100000 at row 2, column 9: beyond the largest float16 value of this "
        "layer (65504)"
    )
