"""One request at a time through each KServe transport, on one server: binary HTTP, gRPC, and
system and CUDA shared memory over both, with the server's own forward time beside each.

    python -m bench.transport_bench --out DIR [--tokens 64] [--requests 300] [--device cuda]

Starts `moe-serve serve` on the demo layers (a subprocess: CUDA IPC needs the client in
another process); the clients are tritonclient.grpc and, for HTTP, httpx with the binary
tensor extension; sends `--requests` sequential requests of `--tokens` FP32 rows per transport
after a warm-up, checks every output against the binary HTTP one, and writes
DIR/transport-bench.json: p50/p90/mean latency, requests/s and the server's mean forward ms.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.environment import current_commit

log = logging.getLogger("bench.transport")

MODEL = "demo"
HIDDEN = 256  # the demo layers' H
WARM_UP = 30
READY_TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward_seconds(url: str) -> tuple[float, float]:
    """(sum, count) of the server's moe_serve_forward_seconds for the demo layer."""
    total = count = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("moe_serve_forward_seconds_") and f'layer="{MODEL}"' in line:
            value = float(line.rsplit(" ", 1)[1])
            if line.startswith("moe_serve_forward_seconds_sum"):
                total += value
            elif line.startswith("moe_serve_forward_seconds_count"):
                count += value
    return total, count


def _time(call: Callable[[], np.ndarray], requests: int) -> tuple[list[float], np.ndarray]:
    for _ in range(WARM_UP):
        out = call()
    latencies = []
    for _ in range(requests):
        started = time.perf_counter()
        out = call()
        latencies.append(time.perf_counter() - started)
    return latencies, out


class HttpKServe:
    """KServe v2 over HTTP with the binary tensor extension, on httpx: tritonclient.http needs
    geventhttpclient, which the GPU machine lacks."""

    def __init__(self, address: str, model: str = "demo") -> None:
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


def _variants(
    http_addr: str, grpc_addr: str, x: np.ndarray, cleanup: list[Callable[[], object]]
) -> dict[str, Callable[[], np.ndarray]]:
    """Each transport as a call that sends x and returns the output; the regions it makes
    are freed by the calls it appends to `cleanup`."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    http = HttpKServe(http_addr)
    grpc = grpcclient.InferenceServerClient(grpc_addr)
    nbytes = x.nbytes
    plain_input = grpcclient.InferInput("hidden_states", list(x.shape), "FP32")
    plain_input.set_data_from_numpy(x)

    def over_grpc(region: str, read: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
        tensor = grpcclient.InferInput("hidden_states", list(x.shape), "FP32")
        tensor.set_shared_memory(region, nbytes)
        out = grpcclient.InferRequestedOutput("output")
        out.set_shared_memory(region, nbytes, offset=nbytes)

        def call() -> np.ndarray:
            grpc.infer(MODEL, [tensor], outputs=[out])
            return read()

        return call

    def over_http(region: str, read: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
        def call() -> np.ndarray:
            http.infer(x, region)
            return read()

        return call

    key = f"/moe-serve-bench-{os.getpid()}"
    system = shm.create_shared_memory_region("bench-sys", key, 2 * nbytes)
    cleanup.append(lambda: shm.destroy_shared_memory_region(system))
    shm.set_shared_memory_region(system, [x])
    http.register_system("bench-sys", key, 2 * nbytes)
    read_system = lambda: shm.get_contents_as_numpy(  # noqa: E731
        system, np.float32, list(x.shape), offset=nbytes
    )
    variants = {
        "http-binary": lambda: http.infer(x),
        "grpc": lambda: grpc.infer(MODEL, [plain_input]).as_numpy("output"),
        "http-system-shm": over_http("bench-sys", read_system),
        "grpc-system-shm": over_grpc("bench-sys", read_system),
    }
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except RuntimeError as err:  # tritonclient raises this without cuda-python
        log.warning("no CUDA shared memory: %s", err)
        return variants
    device = cudashm.create_shared_memory_region("bench-cuda", 2 * nbytes, 0)
    cleanup.append(lambda: cudashm.destroy_shared_memory_region(device))
    cudashm.set_shared_memory_region(device, [x])
    http.register_cuda("bench-cuda", cudashm.get_raw_handle(device), 2 * nbytes)
    # tritonclient reads a CUDA region from its start only: both halves, the output second
    both = [2 * x.shape[0], *x.shape[1:]]
    read_device = lambda: cudashm.get_contents_as_numpy(device, np.float32, both)[x.shape[0] :]  # noqa: E731
    variants["http-cuda-shm"] = over_http("bench-cuda", read_device)
    variants["grpc-cuda-shm"] = over_grpc("bench-cuda", read_device)
    return variants


def run(out_dir: Path, tokens: int, requests: int, device: str) -> dict:
    http_port, grpc_port = _free_port(), _free_port()
    url = f"http://127.0.0.1:{http_port}"
    cache = Path(tempfile.mkdtemp(prefix="moe-bench-cache-"))
    cleanup: list[Callable[[], object]] = []
    server = subprocess.Popen(
        [
            sys.executable, "-m", "service.cli", "serve", "--device", device,
            "--port", str(http_port), "--grpc-port", str(grpc_port), "--allow-shared-memory",
            "--max-batch-tokens", str(tokens), "--cache-dir", str(cache), "--log-level", "warning",
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SERVE_")},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not get ready")
            time.sleep(0.5)
        x = np.random.default_rng(0).standard_normal((tokens, HIDDEN)).astype(np.float32)
        results, reference = {}, None
        addresses = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
        for name, call in _variants(*addresses, x, cleanup).items():
            before = _forward_seconds(url)
            latencies, out = _time(call, requests)
            after = _forward_seconds(url)
            reference = out if reference is None else reference
            forwards = after[1] - before[1]
            ms = np.array(latencies) * 1e3
            results[name] = {
                "p50_ms": float(np.percentile(ms, 50)),
                "p90_ms": float(np.percentile(ms, 90)),
                "mean_ms": float(ms.mean()),
                "requests_per_s": float(len(ms) / (ms.sum() / 1e3)),
                "server_forward_ms": (after[0] - before[0]) / forwards * 1e3 if forwards else None,
                "matches_http_binary": bool(np.array_equal(out, reference)),
            }
            log.info("%-16s p50 %.3f ms  %s", name, results[name]["p50_ms"], results[name])
    finally:
        server.terminate()
        server.wait(60)
        for free in cleanup:
            free()
    report = {
        "commit": current_commit(),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "model": MODEL,
        "tokens": tokens,
        "requests": requests,
        "transports": results,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "transport-bench.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run(args.out, args.tokens, args.requests, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
