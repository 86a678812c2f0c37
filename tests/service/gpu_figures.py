"""The service's GPU figures (issue 5), re-runnable on the device machine:

1. p50 latency of a 64-token binary forward of the demo layer over HTTP, one client at a time,
   against the bare time of the same forward on the device (the MoE layer: router + routing +
   modular kernel; and the modular kernel alone), CUDA events, median;
2. throughput with 64 concurrent clients of 64 tokens each, batching on (defaults) against
   `--max-batch-tokens 64` (one request per forward).

    python -m tests.service.gpu_figures [--duration 8] [--out results.json]

Each server is a `moe-serve serve` subprocess, so the load generator (bench/http_bench.py) does
not share its interpreter. Outputs are checked against the reference backend before timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from bench.http_bench import HttpBenchConfig, LevelResult, run_http_bench
from bench.timing import Timer, TimingPlan
from kernels.layer import build_layer
from kernels.tensors import ForwardInputs
from kernels.testing import relative_error
from service.client import Client
from weights.demo import ensure_demo_layers
from weights.load import load_layer

log = logging.getLogger("gpu_figures")

LAYER = "demo"
TOKENS = 64
CLIENTS = 64
BF16_TOLERANCE = 2e-2  # relative error vs the float32 reference, bf16 output
READY_TIMEOUT_S = 300.0  # first start compiles kernels


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(cache_dir: Path, *options: str) -> Iterator[str]:
    """A `moe-serve serve` subprocess on the GPU; yields its URL once /ready is 200."""
    port = _free_port()
    env = {**os.environ, "MOE_SERVE_CACHE_DIR": str(cache_dir)}
    # warning: a log line per request would be part of what is timed
    command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port)]
    command += ["--log-level", "warning", *options]
    proc = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server not ready")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def bare_times_us(path: Path, device: torch.device) -> dict[str, float | str]:
    """Median device time of the 64-token forward: whole layer, and modular kernel alone."""
    loaded = load_layer(path, device)
    layer, selection = build_layer(loaded.config, loaded.weights, device, "auto")
    reference, _ = build_layer(loaded.config, loaded.weights, device, "reference")
    hidden = torch.randn(TOKENS, loaded.config.hidden_size, device=device).to(loaded.config.dtype)
    inputs = ForwardInputs(hidden)
    with torch.inference_mode():
        out = layer.forward(inputs)
        error = relative_error(out.output, reference.forward(inputs).output)
        if error > BF16_TOLERANCE:
            raise AssertionError(f"{selection.experts.name}: relative error {error:.2e}")
        timer = Timer(device, TimingPlan(warmup=10, min_iters=50, max_iters=500, budget_s=1.0))
        whole = timer.measure(lambda: layer.forward(inputs))
        kernel = timer.measure(lambda: layer.kernel.forward(hidden, out.routing))
    return {
        "backend": selection.experts.name,
        "layer_us": whole.median_us,
        "kernel_us": kernel.median_us,
        "relative_error": error,
    }


def check_server(url: str, path: Path) -> dict[str, str | float]:
    """The server's answer for 64 tokens against the reference on CPU; its backend."""
    loaded = load_layer(path, torch.device("cpu"))
    reference, _ = build_layer(loaded.config, loaded.weights, torch.device("cpu"), "reference")
    hidden = torch.randn(TOKENS, loaded.config.hidden_size).bfloat16()
    with Client(url) as client:
        out = client.forward(LAYER, hidden)
    error = relative_error(out, reference.forward(ForwardInputs(hidden)).output)
    if error > BF16_TOLERANCE:
        raise AssertionError(f"server output: relative error {error:.2e}")
    backends = httpx.get(f"{url}/backends").json()
    chosen = next(b for b in backends["layers"] if b["layer"] == LAYER)
    return {
        "device": backends["device"]["name"],
        "experts": chosen["experts"],
        "reason": chosen["reason"],
        "relative_error": error,
    }


def load(url: str, clients: int, duration_s: float) -> LevelResult:
    config = HttpBenchConfig(
        url=url, layer=LAYER, tokens=TOKENS, concurrency=(clients,), duration_s=duration_s
    )
    return asyncio.run(run_http_bench(config)).levels[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per load level")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        log.error("needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as cache:
        cache_dir = Path(cache)
        path = next(p for p in ensure_demo_layers(cache_dir) if p.name == LAYER)
        bare = bare_times_us(path, device)
        with serve(cache_dir) as url:
            server = check_server(url, path)
            single = load(url, 1, args.duration)
            batched = load(url, CLIENTS, args.duration)
        with serve(cache_dir, "--max-batch-tokens", str(TOKENS)) as url:
            unbatched = load(url, CLIENTS, args.duration)
    figures = {
        "bare": bare,
        "server": server,
        "latency_1_client": single.model_dump(),
        "batching_on_64_clients": batched.model_dump(),
        "max_batch_tokens_64_64_clients": unbatched.model_dump(),
    }
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    rows = [
        ("device / backend", f"{server['device']} / {bare['backend']} ({server['reason']})"),
        ("bare layer forward, 64 tok (median)", f"{bare['layer_us']:.1f} us"),
        ("bare modular kernel, 64 tok (median)", f"{bare['kernel_us']:.1f} us"),
        ("HTTP binary forward, 64 tok, 1 client p50", f"{single.p50_ms * 1e3:.1f} us"),
        ("server forward time per batch (1 client)", f"{single.server_forward_ms * 1e3:.1f} us"),
        (
            "64 clients, batching on",
            f"{batched.requests_per_s:.0f} req/s, {batched.tokens_per_s:,.0f} tok/s, "
            f"p50 {batched.p50_ms:.2f} ms, {batched.server_batch_tokens:.0f} tok/forward",
        ),
        (
            "64 clients, --max-batch-tokens 64",
            f"{unbatched.requests_per_s:.0f} req/s, {unbatched.tokens_per_s:,.0f} tok/s, "
            f"p50 {unbatched.p50_ms:.2f} ms, {unbatched.server_batch_tokens:.0f} tok/forward",
        ),
    ]
    lines = ["| figure | value |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in rows]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if single.errors == batched.errors == unbatched.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
