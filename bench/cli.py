"""`moe-serve bench kernels | plot | summary | http | service`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
from pydantic import ValidationError

from ..kernels.stages import resolve_device
from .auto_table import default_path, merged, rule_table, write_table
from .environment import capture, device_slug
from .http_bench import HttpBenchConfig, run_http_bench, write_report
from .kernel_bench import KernelBench, KernelBenchConfig, read_run
from .router_loads import Load
from .schema import BenchRun
from .shapes import DEFAULT_SHAPES, SHAPES, parse_shapes
from .summary import render
from .timing import TimingPlan

log = logging.getLogger(__name__)

RESULTS_DIR = Path("bench/results")
DEFAULT_TOKENS = ",".join(str(2**i) for i in range(15))  # 1, 2, 4, ..., 16384


def int_list(text: str) -> list[int]:
    """ "1,8,64" -> [1, 8, 64]; each a positive integer."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from err
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _shapes(text: str) -> list[str]:
    try:
        return parse_shapes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _loads(text: str) -> list[Load]:
    try:
        return [Load(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError as err:
        known = ", ".join(load.value for load in Load)
        raise argparse.ArgumentTypeError(f"unknown load in {text!r}; known: {known}") from err


def _device(text: str) -> torch.device:
    try:
        return resolve_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def run_kernels(args: argparse.Namespace) -> int:
    _setup_logging()
    plan = TimingPlan(args.warmup, args.min_iters, args.max_iters, args.budget_ms / 1e3)
    try:
        config = KernelBenchConfig(
            shapes=tuple(args.shapes),
            tokens=tuple(sorted(set(args.tokens))),
            device=args.device,
            backends=None if args.backends == "all" else tuple(args.backends.split(",")),
            loads=tuple(args.loads),
            reference_max_tokens=args.reference_max_tokens,
            check_rows=args.check_rows,
            plan=plan,
            deadline_s=None if args.max_minutes is None else args.max_minutes * 60,
        )
        env = capture(args.device, args.commit)
        out = args.out or RESULTS_DIR / f"{device_slug(env)}-{datetime.now(UTC):%Y-%m-%d}.json"
        KernelBench(config, out, env).run()
    except ValueError as err:
        log.error("%s", err)
        return 2
    log.info("wrote %s", out)
    return 0


def _read(path: Path) -> BenchRun | None:
    try:
        return read_run(path)
    except (OSError, ValidationError) as err:
        log.error("cannot read %s as a kernel benchmark result: %s", path, err)
        return None


def run_plot(args: argparse.Namespace) -> int:
    _setup_logging()
    try:  # matplotlib is the optional `bench` extra
        from .plot import plot_run
    except ImportError as err:
        log.error("plotting needs matplotlib: pip install 'moe-serve[bench]' (%s)", err)
        return 2
    run = _read(args.file)
    if run is None:
        return 2
    for path in plot_run(run, args.file):
        log.info("wrote %s", path)
    return 0


def run_summary(args: argparse.Namespace) -> int:
    _setup_logging()
    run = _read(args.file)
    if run is None:
        return 2
    sys.stdout.write(render(run))
    return 0


def run_auto_table(args: argparse.Namespace) -> int:
    _setup_logging()
    run = _read(args.file)
    if run is None:
        return 2
    out = args.out or default_path(run)
    try:
        table = rule_table(run)
        if args.merge and out.exists():
            table = merged(table, json.loads(out.read_text()))
    except ValueError as err:
        log.error("%s: %s", args.file, err)
        return 2
    write_table(table, out)
    for key, rule in table["rules"].items():
        log.info("%s (%s): %s", key, rule["shape"], ", ".join(rule["order"]))
    log.info("wrote %s and %s", out, out.with_suffix(".md"))
    return 0


def run_http(args: argparse.Namespace) -> int:
    _setup_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request under load
    try:
        config = HttpBenchConfig(
            url=args.url,
            layer=args.layer,
            tokens=args.tokens,
            concurrency=tuple(args.concurrency),
            duration_s=args.duration,
            max_requests=args.max_requests,
            binary=args.binary,
            timeout_s=args.timeout,
            processes=args.processes,
        )
        report = run_http_bench(config)
    except ValueError as err:
        log.error("%s", err)
        return 2
    sys.stdout.write(report.table() + "\n")
    if args.out:
        write_report(report, args.out)
        log.info("wrote %s", args.out)
    return 0


def run_service(args: argparse.Namespace) -> int:
    _setup_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from .service_bench import ServiceBenchConfig, run_service_bench

    try:
        config = ServiceBenchConfig(
            out_dir=args.out,
            layers=tuple(v.strip() for v in args.layers.split(",") if v.strip()),
            clients=tuple(args.clients),
            tokens=args.tokens,
            duration_s=args.duration,
            device=args.device,
            backend=args.backend,
            shared_intermediate=args.shared_intermediate,
            max_batch_tokens=args.max_batch_tokens,
            budget_s=args.budget_s,
            generator=args.generator,
            stack_variant=args.stack_variant,
            http_workers=args.http_workers,
        )
    except ValueError as err:
        log.error("%s", err)
        return 2
    result = run_service_bench(config, args.commit)
    return 1 if result.failures else 0


def _add_service(sub: argparse._SubParsersAction) -> None:
    what = "serve the demo and a DeepSeek-V3-sized layer, load them, compare with the bare forward"
    p = sub.add_parser(
        "service",
        help=what,
        description=f"{what.capitalize()}: every concurrency level with hey (or Python clients), "
        "one client with 1-token and JSON bodies, batching off and uvicorn's pure-Python stack "
        "on the demo layer, the load generator's own capacity; writes service.json and "
        "service.md with issue 16's targets.",
    )
    p.add_argument("--out", type=Path, required=True, help="directory for service.json/.md, logs")
    p.add_argument("--layers", default="deepseek-v3,demo", help="demo and/or bench shapes")
    p.add_argument("--clients", type=int_list, default=[1, 16, 64, 256], help="comma list")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--duration", type=float, default=4.0, help="seconds per level")
    p.add_argument("--device", default="auto", help="the servers' --device")
    p.add_argument("--backend", default="triton", help="the servers' --backend")
    p.add_argument("--shared-intermediate", type=int, default=2048, help="random layers' shared")
    p.add_argument("--max-batch-tokens", type=int, default=1024, help="the servers' batch size")
    p.add_argument("--budget-s", type=float, default=480.0, help="no part starts after this")
    p.add_argument("--generator", default="auto", help="auto (hey if on PATH), hey or python")
    p.add_argument("--no-stack-variant", dest="stack_variant", action="store_false",
                   help="skip the demo layer on uvicorn's h11 parser and asyncio loop")  # fmt: skip
    p.add_argument("--http-workers", type=int, default=8, metavar="N",
                   help="also serve each layer (and batching off) behind N front-end processes "
                   "(0: not)")  # fmt: skip
    p.add_argument("--commit", help="commit to record (default: git rev-parse --short HEAD)")
    p.set_defaults(run=run_service)


def _add_kernels(sub: argparse._SubParsersAction) -> None:
    what = "time every available backend against measured ceilings"
    p = sub.add_parser(
        "kernels",
        help=what,
        description=f"{what.capitalize()} (copy bandwidth, GEMM peak) on each layer shape and "
        "token count: the modular forward and the whole layer uncaptured and, where the backend "
        "can be captured, the whole layer replayed from a CUDA graph (as served); writes a "
        "result file for `bench plot`, `bench summary` and `bench auto-table`.",
    )
    p.add_argument(
        "--shapes",
        type=_shapes,
        default=list(DEFAULT_SHAPES),
        help=f"comma list of {', '.join(SHAPES)} (default {','.join(DEFAULT_SHAPES)})",
    )
    p.add_argument(
        "--tokens",
        type=int_list,
        default=int_list(DEFAULT_TOKENS),
        help=f"comma list of token counts (default {DEFAULT_TOKENS})",
    )
    p.add_argument(
        "--backends",
        default="all",
        help="all, or a comma list of experts backends; NAME+invariant: NAME built "
        "batch-invariant (serve --batch-invariant), e.g. triton,triton+invariant; auto: the "
        "layer --backend auto builds from the rule this run's uniform-load times make, timed "
        "as built after the others",
    )
    p.add_argument(
        "--loads", type=_loads, default=list(Load), help="router loads (default uniform,skewed)"
    )
    p.add_argument("--device", type=_device, default=_device("auto"), help="auto, cpu or cuda[:N]")
    p.add_argument("--out", type=Path, help="result JSON (default bench/results/DEVICE-DATE.json)")
    p.add_argument(
        "--reference-max-tokens",
        type=int,
        default=64,
        help="time the slow reference backends only up to this many tokens",
    )
    p.add_argument("--check-rows", type=int, default=32, help="rows checked against the reference")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per point (default 3)")
    p.add_argument("--min-iters", type=int, default=5, help="timed runs per point, at least")
    p.add_argument("--max-iters", type=int, default=100, help="timed runs per point, at most")
    p.add_argument("--budget-ms", type=float, default=200.0, help="timed work per point")
    p.add_argument("--max-minutes", type=float, help="stop timing new points after this long")
    p.add_argument("--commit", help="commit to record (default: git rev-parse --short HEAD)")
    p.set_defaults(run=run_kernels)


def _add_http(sub: argparse._SubParsersAction) -> None:
    what = "load a running server and report throughput and latency"
    p = sub.add_parser(
        "http",
        help=what,
        description=f"{what.capitalize()} at each concurrency level, with the server's own "
        "forward time read from its /metrics.",
    )
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)"
    )
    p.add_argument("--layer", required=True, help="layer name as listed by /v1/layers")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--concurrency", type=int_list, default=[1, 16, 64, 256], help="comma list")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per concurrency level")
    p.add_argument("--max-requests", type=int, default=100_000, help="per concurrency level")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    p.add_argument(
        "--processes",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 2)),
        help="client processes the clients are spread over (one Python process tops out at a "
        "few thousand requests per second)",
    )
    body = p.add_mutually_exclusive_group()
    body.add_argument(
        "--binary",
        dest="binary",
        action="store_true",
        default=True,
        help="send safetensors bodies (the default)",
    )
    body.add_argument("--json", dest="binary", action="store_false", help="send JSON bodies")
    p.add_argument("--out", type=Path, help="also write the report as JSON")
    p.set_defaults(run=run_http)


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        description="Kernel and service benchmarks; README.md, Performance, shows how they "
        "were run.",
    )
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _add_kernels(sub)
    for name, fn, text in (
        ("plot", run_plot, "draw PNGs beside a kernel result file"),
        ("summary", run_summary, "print a kernel result file as markdown tables"),
    ):
        p = sub.add_parser(name, help=text, description=f"{text.capitalize()}.")
        p.add_argument("file", type=Path, help="a result file of `moe-serve bench kernels`")
        p.set_defaults(run=fn)
    p = sub.add_parser(
        "auto-table",
        help="write the rule table --backend auto follows, from a kernel result file",
        description="Write the rule table --backend auto follows (per layer shape: every "
        "backend's median time at each token count of the uniform load as served, the whole "
        "layer captured in a CUDA graph where the backend captures, and auto's plan: which "
        "backend runs at which token count) from a `moe-serve bench kernels` result, and its "
        "markdown summary beside it.",
    )
    p.add_argument("file", type=Path, help="a `bench kernels` result with the uniform load")
    p.add_argument("--out", type=Path, help="default kernels/tuned/auto_<gpu>.json (+ .md)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the rules of the table already at --out that this run does not measure "
        "(each rule then names the commit it was measured at)",
    )
    p.set_defaults(run=run_auto_table)
    _add_http(sub)
    _add_service(sub)
