"""One request at a time through each KServe transport: binary HTTP, gRPC, and system and CUDA
shared memory over both, on the demo layer and the DeepSeek-V3-sized one, against the server's
own forward time: `moe-serve bench service --mode transport`; its target checked last.

Each layer is served by `bench.service_server` in a subprocess (CUDA IPC needs the client in
another process) with gRPC and shared memory on: the demo layer from the cache, a shape of
bench/shapes.py drawn on the device with DeepSeek-V3's shared expert, as `moe-serve bench
service` serves them. The clients are tritonclient.grpc and, for HTTP, httpx with the binary
tensor extension. Each transport gets `--requests` sequential requests of `--tokens` FP32 rows
after a warm-up; a request's latency runs from sending it to its reply (with shared memory the
output is in the region by then: it is read after the timed requests and must equal the binary
HTTP output). Beside each: the server's mean forward time over that transport's requests (its
metrics: CUDA events around the captured forward as served) and, once per layer, the bare
captured forward (/bench/bare). Where the time goes comes from the server's own numbers over the
same requests: its infer handler (moe_serve_request_seconds), `inference.infer` (the model's
statistics) and the forward; the client and wire floor is a call that does no work (gRPC
ServerLive, HTTP /v2/health/live), with the server's own handler time of it. The targets: CUDA
shared memory p50 <= the server's forward + the same protocol's no-op call + CUDA_SHM_SLACK_MS;
system shared memory within SYSTEM_SHM_EXTRA_MS of that. On a host without a GPU (`--device cpu
--layers demo`) every transport but CUDA shared memory runs, the demo layer's forward on the
CPU.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from .schema import Environment, write_result
from .service_bench import http_ready, process

log = logging.getLogger(__name__)

DEMO = "demo"
SHARED_INTERMEDIATE = 2048  # DeepSeek-V3's shared expert, as `moe-serve bench service` draws it
WARM_UP = 30
READY_TIMEOUT_S = 300.0
CUDA_SHM_SLACK_MS = 0.25  # CUDA shared memory p50 <= forward + the no-op call + this
SYSTEM_SHM_EXTRA_MS = 0.5  # system shared memory: the CUDA target + this
CUDA_SHM = ("http-cuda-shm", "grpc-cuda-shm")
SHM_SLACK_MS = {
    **dict.fromkeys(CUDA_SHM, CUDA_SHM_SLACK_MS),
    "http-system-shm": CUDA_SHM_SLACK_MS + SYSTEM_SHM_EXTRA_MS,
    "grpc-system-shm": CUDA_SHM_SLACK_MS + SYSTEM_SHM_EXTRA_MS,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROUTES = {"http": "/v2/models/{name}/infer", "grpc": "grpc ModelInfer"}  # metrics' route label
NO_OP_ROUTES = {"http": "/v2/health/live", "grpc": "grpc ServerLive"}  # the floor's calls


@dataclass(frozen=True)
class ServerTimes:
    """Cumulative (seconds, count) pairs the server reports: its forwards of the layer
    (moe_serve_forward_seconds), each transport's infer handler (moe_serve_request_seconds),
    and the layer's requests from the statistics' start to end of `inference.infer`."""

    forward: tuple[float, float]
    handler: dict[str, tuple[float, float]]  # by route label (ROUTES, NO_OP_ROUTES)
    infer: tuple[float, float]


def _server_times(url: str, layer: str) -> ServerTimes:
    sums: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        forward = line.startswith("moe_serve_forward_seconds_") and f'layer="{layer}"' in line
        handler = line.startswith("moe_serve_request_seconds_")
        if forward or handler:
            key = line.split("{", 1)[0] + (
                "" if forward else line.split('route="', 1)[1].split('"', 1)[0]
            )
            sums[key] = sums.get(key, 0.0) + float(line.rsplit(" ", 1)[1])

    def pair(metric: str, route: str = "") -> tuple[float, float]:
        return sums.get(f"{metric}_sum{route}", 0.0), sums.get(f"{metric}_count{route}", 0.0)

    stats = httpx.get(f"{url}/v2/models/{layer}/stats").json()["model_stats"][0]
    success = stats["inference_stats"]["success"]
    return ServerTimes(
        forward=pair("moe_serve_forward_seconds"),
        handler={
            r: pair("moe_serve_request_seconds", r)
            for r in (*ROUTES.values(), *NO_OP_ROUTES.values())
        },
        infer=(success["ns"] / 1e9, success["count"]),
    )


def _mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    count = after[1] - before[1]
    return (after[0] - before[0]) / count * 1e3 if count else None


@dataclass(frozen=True)
class Transport:
    send: Callable[[], np.ndarray | None]  # one request; the output where the reply has it
    read: Callable[[], np.ndarray] | None = None  # the output from its region, once sent


def _time(transport: Transport, requests: int) -> tuple[list[float], np.ndarray]:
    """Latencies of `requests` sequential requests, and the last output."""
    latencies = []
    for _ in range(requests):
        started = time.perf_counter()
        out = transport.send()
        latencies.append(time.perf_counter() - started)
    return latencies, out if transport.read is None else transport.read()


def _floors(
    http_addr: str, grpc_addr: str, requests: int, layer: str
) -> dict[str, dict[str, float | None]]:
    """The client and transport floor: p50 and mean of a trivial call that does no work on the
    server (gRPC ServerLive, HTTP GET /v2/health/live), one at a time as the others, and the
    server's own handler time of it (moe_serve_request_seconds)."""
    import tritonclient.grpc as grpcclient

    url = f"http://{http_addr}"
    with (
        grpcclient.InferenceServerClient(grpc_addr) as grpc,
        httpx.Client(base_url=url) as http,
    ):
        calls = {"grpc": grpc.is_server_live, "http": lambda: http.get(NO_OP_ROUTES["http"])}
        floors = {}
        for name, call in calls.items():
            for _ in range(WARM_UP):
                call()
            before = _server_times(url, layer)
            ms = np.array(_time(Transport(call), requests)[0]) * 1e3
            after = _server_times(url, layer)
            route = NO_OP_ROUTES[name]
            floors[name] = {
                "p50_ms": float(np.percentile(ms, 50)),
                "mean_ms": float(ms.mean()),
                "server_handler_ms": _mean_ms(before.handler[route], after.handler[route]),
            }
    return floors


class HttpKServe:
    """KServe v2 over HTTP with the binary tensor extension, on httpx: tritonclient.http needs
    geventhttpclient, which the GPU machine lacks."""

    def __init__(self, address: str, model: str = DEMO) -> None:
        self.http = httpx.Client(base_url=f"http://{address}", timeout=60)
        self.model = model

    def register_system(self, name: str, key: str, byte_size: int) -> None:
        body = {"key": key, "offset": 0, "byte_size": byte_size}
        self.http.post(
            f"/v2/systemsharedmemory/region/{name}/register", json=body
        ).raise_for_status()

    def register_cuda(self, name: str, raw_handle: bytes, byte_size: int) -> None:
        body = {"raw_handle": {"b64": raw_handle.decode()}, "device_id": 0, "byte_size": byte_size}
        self.http.post(f"/v2/cudasharedmemory/region/{name}/register", json=body).raise_for_status()

    def infer(self, x: np.ndarray, region: str | None = None) -> np.ndarray | None:
        """x sent binary and the output back binary; or both in `region` (input at 0, output
        after it), when the output is read from the region by the caller."""
        entry = {"name": "hidden_states", "shape": list(x.shape), "datatype": "FP32"}
        if region is None:
            entry["parameters"] = {"binary_data_size": x.nbytes}
            output = {"name": "output", "parameters": {"binary_data": True}}
        else:
            entry["parameters"] = {
                "shared_memory_region": region,
                "shared_memory_byte_size": x.nbytes,
            }
            output = {
                "name": "output",
                "parameters": {
                    "shared_memory_region": region,
                    "shared_memory_byte_size": x.nbytes,
                    "shared_memory_offset": x.nbytes,
                },
            }
        header = json.dumps({"inputs": [entry], "outputs": [output]}).encode()
        body = header if region is not None else header + x.tobytes()
        r = self.http.post(
            f"/v2/models/{self.model}/infer",
            content=body,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
        r.raise_for_status()
        if region is not None:
            return None
        split = int(r.headers["Inference-Header-Content-Length"])
        return np.frombuffer(r.content[split:], dtype=np.float32).reshape(x.shape)


def _transports(
    http_addr: str, grpc_addr: str, model: str, x: np.ndarray, cleanup: list[Callable[[], object]]
) -> dict[str, Transport]:
    """Each transport, sending x; the regions it makes are freed by the calls it appends to
    `cleanup`."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    http = HttpKServe(http_addr, model)
    grpc = grpcclient.InferenceServerClient(grpc_addr)
    nbytes = x.nbytes
    plain_input = grpcclient.InferInput("hidden_states", list(x.shape), "FP32")
    plain_input.set_data_from_numpy(x)

    cleanup.append(grpc.close)

    def over_grpc(region: str) -> Callable[[], None]:
        tensor = grpcclient.InferInput("hidden_states", list(x.shape), "FP32")
        tensor.set_shared_memory(region, nbytes)
        out = grpcclient.InferRequestedOutput("output")
        out.set_shared_memory(region, nbytes, offset=nbytes)

        def send() -> None:
            grpc.infer(model, [tensor], outputs=[out])

        return send

    system_name = f"bench-sys-{model}"
    key = f"/moe-serve-bench-{os.getpid()}-{model}"
    system = shm.create_shared_memory_region(system_name, key, 2 * nbytes)
    cleanup.append(lambda: shm.destroy_shared_memory_region(system))
    shm.set_shared_memory_region(system, [x])
    http.register_system(system_name, key, 2 * nbytes)
    read_system = lambda: shm.get_contents_as_numpy(  # noqa: E731
        system, np.float32, list(x.shape), offset=nbytes
    )
    transports = {
        "http-binary": Transport(lambda: http.infer(x)),
        "grpc": Transport(lambda: grpc.infer(model, [plain_input]).as_numpy("output")),
        "http-system-shm": Transport(lambda: http.infer(x, system_name), read_system),
        "grpc-system-shm": Transport(over_grpc(system_name), read_system),
    }
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except RuntimeError as err:  # tritonclient raises this without cuda-python
        log.warning("no CUDA shared memory: %s", err)
        return transports
    cuda_name = f"bench-cuda-{model}"
    device = cudashm.create_shared_memory_region(cuda_name, 2 * nbytes, 0)
    cleanup.append(lambda: cudashm.destroy_shared_memory_region(device))
    cudashm.set_shared_memory_region(device, [x])
    http.register_cuda(cuda_name, cudashm.get_raw_handle(device), 2 * nbytes)
    # tritonclient reads a CUDA region from its start only: both halves, the output second
    both = [2 * x.shape[0], *x.shape[1:]]
    read_device = lambda: cudashm.get_contents_as_numpy(device, np.float32, both)[x.shape[0] :]  # noqa: E731
    transports["http-cuda-shm"] = Transport(lambda: http.infer(x, cuda_name), read_device)
    transports["grpc-cuda-shm"] = Transport(over_grpc(cuda_name), read_device)
    return transports


def _server_command(layer: str, port: int, grpc_port: int, tokens: int, device: str, cache: Path):
    command = [sys.executable, "-m", "moe_serve.bench.service_server", "--layer", layer,
               "--port", str(port), "--grpc-port", str(grpc_port), "--allow-shared-memory",
               "--device", device, "--max-batch-tokens", str(tokens),
               "--cache-dir", str(cache)]  # fmt: skip
    if layer != DEMO:
        command += ["--shared-intermediate", str(SHARED_INTERMEDIATE)]
    return command


def run_layer(layer: str, out_dir: Path, tokens: int, requests: int, device: str) -> dict:
    """Every transport on one layer's server: {transports: {name: figures}, bare_forward_ms}."""
    http_port, grpc_port = _free_port(), _free_port()
    url = f"http://127.0.0.1:{http_port}"
    cache = Path(tempfile.mkdtemp(prefix="moe-bench-cache-"))
    command = _server_command(layer, http_port, grpc_port, tokens, device, cache)
    cleanup: list[Callable[[], object]] = []
    results: dict[str, dict] = {}
    log_path = out_dir / f"server-{layer}.log"
    with process(command, log_path, http_ready(url), READY_TIMEOUT_S) as ready_s:
        try:
            hidden = httpx.get(f"{url}/v1/layers/{layer}", timeout=10).json()["hidden_size"]
            x = np.random.default_rng(0).standard_normal((tokens, hidden)).astype(np.float32)
            reference = None
            addresses = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
            for name, transport in _transports(*addresses, layer, x, cleanup).items():
                for _ in range(WARM_UP):
                    transport.send()
                before = _server_times(url, layer)
                latencies, out = _time(transport, requests)
                after = _server_times(url, layer)
                reference = out if reference is None else reference
                ms = np.array(latencies) * 1e3
                kind = name.split("-", 1)[0]  # http or grpc
                results[name] = {
                    "p50_ms": float(np.percentile(ms, 50)),
                    "p90_ms": float(np.percentile(ms, 90)),
                    "mean_ms": float(ms.mean()),
                    "requests_per_s": float(len(ms) / (ms.sum() / 1e3)),
                    "server_forward_ms": _mean_ms(before.forward, after.forward),
                    "server_handler_ms": _mean_ms(
                        before.handler[ROUTES[kind]], after.handler[ROUTES[kind]]
                    ),
                    "server_infer_ms": _mean_ms(before.infer, after.infer),
                    "matches_http_binary": bool(np.array_equal(out, reference)),
                }
                log.info("%s %-16s %s", layer, name, results[name])
            floor = _floors(*addresses, requests, layer)
            bare = httpx.post(f"{url}/bench/bare", json={"tokens": [tokens]}, timeout=600).json()
        finally:
            for free in cleanup:
                free()
    return {
        "seconds_to_ready": ready_s,
        "hidden_size": hidden,
        "bare_forward_ms": bare[0]["median_us"] / 1e3,
        "bare_graphs": bare[0]["graphs"],
        "transports": results,
        "floor": floor,
    }


@dataclass(frozen=True)
class Check:
    target: str
    figure: str
    met: bool | None


def checks(report: dict) -> list[Check]:
    """The targets on each layer: a shared-memory transport's p50 <= the captured forward (the
    server's, over the same requests) + its protocol's no-op call (the floor's p50) + its slack
    (SHM_SLACK_MS): what the server adds to a request beyond the forward and the wire."""
    found = []
    for layer, result in report["layers"].items():
        for name, slack in SHM_SLACK_MS.items():
            protocol = name.split("-")[0]
            target = f"{layer}: {name} p50 <= server forward + {protocol} no-op call + {slack} ms"
            figures = result.get("transports", {}).get(name)
            floor = result.get("floor", {}).get(protocol)
            if figures is None or figures["server_forward_ms"] is None or floor is None:
                found.append(Check(target, result.get("error", "not measured"), None))
                continue
            p50, forward, noop = figures["p50_ms"], figures["server_forward_ms"], floor["p50_ms"]
            found.append(
                Check(
                    target,
                    f"p50 {p50:.3f} ms, forward {forward:.3f} ms, no-op {noop:.3f} ms "
                    f"(+{p50 - forward - noop:.3f})",
                    p50 <= forward + noop + slack,
                )
            )
    return found


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render(report: dict) -> str:
    env = Environment.model_validate(report["environment"])
    lines = [
        f"# KServe transports, one request at a time: {env.device}, commit {env.commit}",
        "",
        f"{report['tokens']} FP32 rows per request, {report['requests']} sequential requests per "
        f"transport after {WARM_UP} warm-up ones; latency from sending to the reply (shared "
        "memory: the output is in the region by then).",
        "",
        "| layer | transport | p50 ms | p90 ms | mean ms | req/s | server fwd ms "
        "| p50 - fwd ms | equals binary |",
        "|" + " --- |" * 9,
    ]
    for layer, result in report["layers"].items():
        for name, f in result.get("transports", {}).items():
            forward = f["server_forward_ms"]
            over = None if forward is None else f["p50_ms"] - forward
            lines.append(
                f"| {layer} | {name} | {_ms(f['p50_ms'])} | {_ms(f['p90_ms'])} "
                f"| {_ms(f['mean_ms'])} | {f['requests_per_s']:,.0f} | {_ms(forward)} "
                f"| {_ms(over)} | {'yes' if f['matches_http_binary'] else 'NO'} |"
            )
    lines += [
        "",
        "Where a request's time goes (means, ms): the client and the wire (latency - the "
        "server's infer handler, moe_serve_request_seconds), the handler outside "
        "`inference.infer` (decode, encode, the transport's request plumbing), `infer` outside "
        "the forward (input checks, the batcher's queue and thread hops, staging and copies), "
        "and the forward:",
        "",
        "| layer | transport | mean | client + wire | handler - infer | infer - forward "
        "| forward |",
        "|" + " --- |" * 7,
    ]
    for layer, result in report["layers"].items():
        for name, f in result.get("transports", {}).items():
            handler, infer = f.get("server_handler_ms"), f.get("server_infer_ms")
            forward = f["server_forward_ms"]
            parts = [
                None if handler is None else f["mean_ms"] - handler,
                None if None in (handler, infer) else handler - infer,
                None if None in (infer, forward) else infer - forward,
            ]
            lines.append(
                f"| {layer} | {name} | {_ms(f['mean_ms'])} | "
                + " | ".join(map(_ms, parts))
                + f" | {_ms(forward)} |"
            )
    lines += [
        "",
        "The client and wire floor, a call that does no work (p50 / mean ms; the server's "
        "handler of it, mean ms):",
        "",
    ]
    for layer, result in report["layers"].items():
        if "floor" in result:
            grpc, http = result["floor"]["grpc"], result["floor"]["http"]
            served = {kind: _ms(f.get("server_handler_ms")) for kind, f in result["floor"].items()}
            lines.append(
                f"- {layer}: gRPC ServerLive {grpc['p50_ms']:.3f} / {grpc['mean_ms']:.3f} "
                f"({served['grpc']}), HTTP GET /v2/health/live {http['p50_ms']:.3f} / "
                f"{http['mean_ms']:.3f} ({served['http']})"
            )
    lines += ["", "Bare captured forward (/bench/bare, CUDA events, back to back):", ""]
    for layer, result in report["layers"].items():
        if "bare_forward_ms" in result:
            lines.append(
                f"- {layer}: {result['bare_forward_ms']:.3f} ms at {report['tokens']} tokens "
                f"({'graph replay' if result['bare_graphs'] else 'uncaptured'}); server ready "
                f"in {result['seconds_to_ready']:.0f} s"
            )
        else:
            lines.append(f"- {layer}: FAILED: {result['error']}")
    met = {True: "yes", False: "NO", None: "-"}
    lines += ["", "| target | measured | met |", "| --- | --- | --- |"]
    lines += [f"| {c['target']} | {c['figure']} | {met[c['met']]} |" for c in report["checks"]]
    return "\n".join(lines) + "\n"


def run(
    layers: list[str], tokens: int, requests: int, device: str, env: Environment, path: Path
) -> dict:
    """Every transport on each layer; writes `path` and its .md, the servers' logs beside them."""
    logs = path.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "environment": env.model_dump(),
        "tokens": tokens,
        "requests": requests,
        "layers": {},
    }
    for layer in layers:
        try:
            report["layers"][layer] = run_layer(layer, logs, tokens, requests, device)
        except Exception as err:  # one layer's failure leaves the others' figures
            log.exception("layer %s failed", layer)
            report["layers"][layer] = {"error": f"{type(err).__name__}: {err}"}
    report["checks"] = [c.__dict__ for c in checks(report)]
    write_result(path, report, render(report))
    return report
