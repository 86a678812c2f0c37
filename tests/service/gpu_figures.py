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
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from bench.http_bench import HttpBenchConfig, run_http_bench
from bench.timing import Timer, TimingPlan
from kernels.accuracy import relative_error, tolerance
from kernels.layer import build_layer
from kernels.tensors import ForwardInputs
from service.client import Client
from weights.demo import ensure_demo_layers
from weights.load import load_layer

log = logging.getLogger("gpu_figures")

LAYER = "demo"
TOKENS = 64
CLIENTS = 64
CLIENT_PROCESSES = 4  # one Python HTTP stack would cap the throughput, not the server
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
        if error > tolerance(loaded.config):
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
    if error > tolerance(loaded.config):
        raise AssertionError(f"server output: relative error {error:.2e}")
    backends = httpx.get(f"{url}/backends").json()
    chosen = next(b for b in backends["layers"] if b["layer"] == LAYER)
    return {
        "device": backends["device"]["name"],
        "experts": chosen["experts"],
        "reason": chosen["reason"],
        "relative_error": error,
    }


def load(url: str, clients: int, duration_s: float) -> dict:
    config = HttpBenchConfig(
        url=url,
        layer=LAYER,
        tokens=TOKENS,
        concurrency=(clients,),
        duration_s=duration_s,
        processes=min(CLIENT_PROCESSES, clients),
    )
    level = run_http_bench(config).levels[0]
    if level.errors:
        raise RuntimeError(f"{level.errors} requests failed: {level.error_kinds}")
    return level.model_dump()


def _throughput(level: dict) -> str:
    return (
        f"{level['requests_per_s']:.0f} req/s, {level['tokens_per_s']:,.0f} tok/s, "
        f"p50 {level['p50_ms']:.2f} ms, {level['server_batch_tokens']:.0f} tok/forward"
    )


ROWS = (  # (figure, measurement it comes from, how to print it)
    (
        "device / experts backend",
        "server",
        lambda f: f"{f['device']} / {f['experts']} ({f['reason']})",
    ),
    ("bare layer forward, 64 tok, median", "bare", lambda f: f"{f['layer_us']:.1f} us"),
    ("bare modular kernel, 64 tok, median", "bare", lambda f: f"{f['kernel_us']:.1f} us"),
    (
        "HTTP binary forward, 64 tok, 1 client, p50",
        "one_client",
        lambda f: f"{f['p50_ms'] * 1e3:.1f} us",
    ),
    (
        "server forward time per batch, 1 client",
        "one_client",
        lambda f: f"{f['server_forward_ms'] * 1e3:.1f} us",
    ),
    ("64 clients x 64 tok, batching on", "batching_on", _throughput),
    ("64 clients x 64 tok, --max-batch-tokens 64", "batching_off", _throughput),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per load level")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    if not torch.cuda.is_available():
        log.error("needs a CUDA GPU")
        return 2
    figures: dict[str, dict] = {}
    failures: dict[str, str] = {}

    def attempt(name: str, measure: Callable[[], dict]) -> None:
        """One measurement; a failure is recorded and the others still run."""
        try:
            figures[name] = measure()
        except Exception as err:
            log.exception("%s failed", name)
            failures[name] = f"{type(err).__name__}: {err}"

    with tempfile.TemporaryDirectory() as cache:
        cache_dir = Path(cache)
        path = next(p for p in ensure_demo_layers(cache_dir) if p.name == LAYER)
        attempt("bare", lambda: bare_times_us(path, torch.device("cuda")))
        try:
            with serve(cache_dir) as url:
                attempt("server", lambda: check_server(url, path))
                attempt("one_client", lambda: load(url, 1, args.duration))
                attempt("batching_on", lambda: load(url, CLIENTS, args.duration))
            with serve(cache_dir, "--max-batch-tokens", str(TOKENS)) as url:
                attempt("batching_off", lambda: load(url, CLIENTS, args.duration))
        except Exception as err:
            log.exception("a server did not start")
            failures["serve"] = f"{type(err).__name__}: {err}"
    if args.out:
        args.out.write_text(json.dumps({"figures": figures, "failures": failures}, indent=1))
    lines = ["| figure | value |", "| --- | --- |"]
    for label, source, show in ROWS:
        value = show(figures[source]) if source in figures else "not measured"
        lines.append(f"| {label} | {value} |")
    lines += [f"| FAILED {name} | {why} |" for name, why in failures.items()]
    sys.stdout.write("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
