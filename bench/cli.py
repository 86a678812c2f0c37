"""`moe-serve bench kernels | service | ep | tune | report`: every benchmark, one command each,
its variants as `--mode`s.

A run's result lands in bench/results/<gpu>/<bench>-<date>-<commit>.json (`--out` moves the
results folder; bench/schema.py), with its tables beside it as .md and its working files (logs,
profiles) in a folder of the same name; `moe-serve bench report` makes docs/performance.md and
the results index from the stored results. This module imports only the standard library:
`moe-serve --help` loads no benchmark, each command imports its modules when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

RESULTS = Path("bench/results")
PERFORMANCE_PAGE = Path("docs/performance.md")
KERNEL_TOKENS = [2**i for i in range(15)]  # 1, 2, 4, ..., 16384
EXTERNAL = ["deep-gemm", "deep-gemm-batched", "oai-triton", "oai-triton-unfused"]


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


def name_list(text: str) -> list[str]:
    """ "a, b," -> ["a", "b"]."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _shapes(text: str) -> list[str]:
    """Layer shapes of bench/shapes.py (which loads torch: only when given)."""
    from .shapes import parse_shapes

    try:
        return parse_shapes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _loads(text: str) -> list[str]:
    from .router_loads import Load

    try:
        return [Load(v).value for v in name_list(text)]
    except ValueError as err:
        known = ", ".join(load.value for load in Load)
        raise argparse.ArgumentTypeError(f"unknown load in {text!r}; known: {known}") from err


def _tune_shape(text: str) -> object:
    """A shape name or E,H,I,top_k as a MoEConfig (bench/tune.py loads torch: only when given)."""
    from .tune import parse_shape

    return parse_shape(text)


def _scheme(text: str) -> object:
    """A QuantScheme (kernels/quant_scheme.py loads torch: only when given)."""
    from ..kernels.quant_scheme import QuantScheme

    try:
        return QuantScheme(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"one of {', '.join(QuantScheme)}") from err


def _show(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


class Command:
    """One `bench` subcommand whose options each apply to some of its modes, with a default per
    mode: an option a mode does not take is refused, and the run records the command as given.
    """

    def __init__(
        self,
        sub: argparse._SubParsersAction,
        name: str,
        what: str,
        description: str,
        modes: dict[str, str],
        run: Callable[[argparse.Namespace], int],
    ) -> None:
        self.name = name
        self.modes = tuple(modes)
        self.options: dict[str, tuple[str, dict[str, object]]] = {}  # dest -> (flag, defaults)
        description = textwrap.fill(description, 94)
        if len(modes) > 1:
            width = max(map(len, modes)) + 2
            description += "\n\nmodes:\n" + "\n".join(
                textwrap.fill(text, 94, initial_indent=f"  {mode:<{width}}",
                              subsequent_indent=" " * (width + 2))
                for mode, text in modes.items()
            )  # fmt: skip
        self.parser = sub.add_parser(
            name,
            help=what,
            description=description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if len(modes) > 1:
            self.parser.add_argument(
                "--mode",
                choices=self.modes,
                default=self.modes[0],
                help=f"the mode (default {self.modes[0]}; each is described above)",
            )
        self.parser.set_defaults(
            run=lambda args: run(self.resolve(args)), mode=self.modes[0], spec=self
        )

    def add(
        self, flag: str, help: str, defaults: dict[str, object] | None = None, **kwargs: object
    ) -> None:
        """`flag` for the modes in `defaults` (mode -> its default; None: every mode, no
        default), described by `help` with where it applies and its defaults."""
        defaults = dict.fromkeys(self.modes) if defaults is None else defaults
        action = self.parser.add_argument(flag, default=None, help=help, **kwargs)
        if len(self.modes) > 1 and set(defaults) != set(self.modes):
            action.help = f"[{', '.join(defaults)}] {action.help}"
        action.help += _defaults_text(defaults)
        flag = action.option_strings[0] if action.option_strings else ""
        self.options[action.dest] = (flag, defaults)

    def resolve(self, args: argparse.Namespace) -> argparse.Namespace:
        """Each option the mode takes at its value or the mode's default; the command as given
        (`args.command`)."""
        given = [f"moe-serve bench {self.name}"]
        if len(self.modes) > 1:
            given.append(f"--mode {args.mode}")
        for dest, (flag, defaults) in self.options.items():
            value = getattr(args, dest)
            if value is None:
                setattr(args, dest, defaults.get(args.mode))
                continue
            if args.mode not in defaults:
                self.parser.error(f"{flag or dest} does not apply to --mode {args.mode}")
            if dest not in ("out", "commit"):  # where it is stored is not how it was made
                given.append(_given(flag, value))
        args.command = " ".join(given)
        return args


def _defaults_text(defaults: dict[str, object]) -> str:
    """ " (default A; mode: B)": the value most modes share first, unlabelled."""
    shown: dict[str, list[str]] = {}
    for mode, value in defaults.items():
        if value is not None and value is not False:
            shown.setdefault(_shown(value), []).append(mode)
    if not shown:
        return ""
    common = max(shown, key=lambda text: len(shown[text]))
    if len(shown[common]) < min(2, len(defaults)):
        parts = [f"{modes[0]}: {text}" for text, modes in shown.items()]
    else:
        parts = [common] + [f"{', '.join(m)}: {t}" for t, m in shown.items() if t != common]
    return f" (default {'; '.join(parts)})"


def _shown(value: object) -> str:
    if isinstance(value, list | tuple):
        return ",".join(map(str, value))
    return str(value)


def _given(flag: str, value: object) -> str:
    if value is True:
        return flag
    text = shlex.quote(_shown(value))
    return f"{flag} {text}" if flag else text


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request under load


def _common(command: Command) -> None:
    command.add(
        "--out",
        "results folder: the result goes to OUT/<gpu>/<bench>-<date>-<commit>"
        ".json, its tables beside it (.md)",
        dict.fromkeys(command.modes, RESULTS),
        type=Path,
        metavar="DIR",
    )
    command.add(
        "--commit", "the commit to record (default: git rev-parse --short HEAD)", metavar="HASH"
    )


# ---- kernels ---------------------------------------------------------------------------------


def run_kernels(args: argparse.Namespace) -> int:
    _setup_logging()
    import torch

    from ..kernels.stages import resolve_device
    from .environment import capture
    from .schema import result_path
    from .shapes import DEFAULT_SHAPES

    try:
        device = resolve_device(args.device) if args.mode == "backends" else torch.device("cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--mode {args.mode} runs on a CUDA GPU; none is visible here")
        env = capture(device, args.commit, args.command)
        if args.mode == "external-alone":
            from ..kernels.timing import TimingPlan
            from .external_alone import run

            plan = TimingPlan(args.warmup, args.min_iters, args.max_iters, args.budget_ms / 1e3)
            path = result_path(args.out, env, "external-alone")
            run(tuple(args.tokens), plan, frozenset(args.backends), env, path)
        elif args.mode == "profile":
            from .layer_profile import run

            path = result_path(args.out, env, "layer-profile")
            inline = args.shared_in_line
            run(args.shapes, args.backends, args.tokens, args.replays, inline, env, path)
        else:
            from ..kernels.timing import TimingPlan
            from .kernel_bench import KernelBench, KernelBenchConfig
            from .router_loads import Load

            plan = TimingPlan(args.warmup, args.min_iters, args.max_iters, args.budget_ms / 1e3)
            config = KernelBenchConfig(
                shapes=tuple(args.shapes or DEFAULT_SHAPES),
                tokens=tuple(sorted(set(args.tokens))),
                device=device,
                backends=None if args.backends == ["all"] else tuple(args.backends),
                loads=tuple(Load(load) for load in args.loads),
                reference_max_tokens=args.reference_max_tokens,
                check_rows=args.check_rows,
                plan=plan,
                deadline_s=None if args.max_minutes is None else args.max_minutes * 60,
            )
            # a run of one shape is named by it: shapes run one by one at a commit all stay
            one = f"-{config.shapes[0]}" if len(config.shapes) == 1 else ""
            path = result_path(args.out, env, f"kernels{one}")
            KernelBench(config, path, env).run()
    except ValueError as err:
        log.error("%s", err)
        return 2
    log.info("wrote %s", path)
    return 0


def _add_kernels(sub: argparse._SubParsersAction) -> None:
    modes = {
        "backends": "every backend on each layer shape and token count against the measured "
        "ceilings (copy bandwidth, GEMM peak): the modular forward, the whole layer uncaptured "
        "and, where the backend captures, replayed from a CUDA graph (as served)",
        "external-alone": "each external backend (DeepGEMM, triton_kernels) against its "
        "library called alone on the same inputs, uncaptured and captured",
        "profile": "the whole layer as served (router and shared expert included) replayed "
        "under torch's profiler: its kernels by time, a Chrome trace and the median replay "
        "kernel by kernel",
    }
    c = Command(
        sub,
        "kernels",
        "time the experts backends on one GPU",
        "Time the experts backends on one GPU (CUDA events, L2 flushed, medians).",
        modes,
        run_kernels,
    )
    c.add(
        "--shapes",
        "comma list of layer shapes of bench/shapes.py (backends: the reference shapes if none)",
        {"backends": None, "profile": ["deepseek-v3"]},
        type=_shapes,
    )
    c.add(
        "--tokens",
        "comma list of token counts",
        {
            "backends": KERNEL_TOKENS,
            "external-alone": [1, 16, 64, 512, 4096],
            "profile": [1, 64, 4096],
        },
        type=int_list,
    )
    c.add(
        "--backends",
        "comma list of experts backends (backends: all; NAME+invariant: NAME "
        "built batch-invariant, as serve --batch-invariant; auto: the layer --backend auto "
        "builds from this run's uniform-load rule, timed as built after the others, then at "
        "each point as served interleaved with the member it runs there: member, auto, auto, "
        "member, twice)",
        {"backends": ["all"], "external-alone": EXTERNAL, "profile": ["triton"]},
        type=name_list,
    )
    c.add(
        "--loads",
        "comma list of router loads: uniform, skewed",
        {"backends": ["uniform", "skewed"]},
        type=_loads,
    )
    c.add("--device", "auto, cpu or cuda[:N]", {"backends": "auto"})
    c.add(
        "--reference-max-tokens",
        "time the slow reference backends only up to this many tokens",
        {"backends": 64},
        type=int,
    )
    c.add("--check-rows", "rows checked against the reference", {"backends": 32}, type=int)
    plan = ("backends", "external-alone")
    c.add("--warmup", "untimed runs per point", dict.fromkeys(plan, 3), type=int)
    c.add("--min-iters", "timed runs per point, at least", dict.fromkeys(plan, 5), type=int)
    c.add(
        "--max-iters",
        "timed runs per point, at most",
        {"backends": 100, "external-alone": 50},
        type=int,
    )
    c.add(
        "--budget-ms",
        "timed work per point",
        {"backends": 200.0, "external-alone": 150.0},
        type=float,
    )
    c.add("--max-minutes", "stop timing new points after this long", {"backends": None}, type=float)
    c.add("--replays", "profiled replays per token count", {"profile": 20}, type=int)
    c.add(
        "--shared-in-line",
        "run the shared expert in the forward's stream, not beside it",
        {"profile": False},
        action="store_true",
    )
    _common(c)


# ---- service ---------------------------------------------------------------------------------


def run_service(args: argparse.Namespace) -> int:
    _setup_logging()
    import torch

    from .environment import capture
    from .schema import result_path

    on_cpu = args.mode in ("channel", "front-end") or args.device == "cpu"
    cuda = torch.cuda.is_available() and not on_cpu
    env = capture(torch.device("cuda" if cuda else "cpu"), args.commit, args.command)
    names = {
        "load": "service",
        "path": "request-path",
        "timeline": "request-timeline",
        "weights": "weight-loading",
    }
    path = result_path(args.out, env, names.get(args.mode, args.mode))
    try:
        failed = _SERVICE_MODES[args.mode](args, env, path)
    except ValueError as err:
        log.error("%s", err)
        return 2
    log.info("wrote %s", path)
    return 1 if failed else 0


def _service_load(args: argparse.Namespace, env, path: Path) -> bool:
    from .service_bench import ServiceBench, ServiceBenchConfig, render

    config = ServiceBenchConfig(
        layers=tuple(args.layers),
        clients=tuple(args.clients),
        tokens=args.tokens,
        duration_s=args.duration,
        device=args.device,
        backend=args.backend,
        shared_intermediate=args.shared_intermediate,
        max_batch_tokens=args.max_batch_tokens,
        budget_s=args.budget_s,
        generator=args.generator,
        stack_variant=not args.no_stack_variant,
        http_workers=args.front_ends,
        one_process=not args.no_one_process,
    )
    result = ServiceBench(config, env, path).run()
    _show(render(result))
    return bool(result.failures)


def _service_http(args: argparse.Namespace, env, path: Path) -> bool:
    from .http_bench import HttpBenchConfig, run_http_bench
    from .schema import write_result

    reports = {}
    for layer in args.layers:
        config = HttpBenchConfig(
            url=args.url,
            layer=layer,
            tokens=args.tokens,
            concurrency=tuple(args.clients),
            duration_s=args.duration,
            max_requests=args.max_requests,
            binary=not args.json,
            timeout_s=args.timeout,
            processes=args.processes,
        )
        reports[layer] = run_http_bench(config)
    tables = "\n\n".join(f"## {layer}\n\n{r.table()}" for layer, r in reports.items())
    layers = {layer: report.model_dump() for layer, report in reports.items()}
    body = {"environment": env.model_dump(), "layers": layers}
    write_result(path, body, f"# {args.url}: {env.device}, commit {env.commit}\n\n{tables}\n")
    _show(tables)
    return False


def _service_transport(args: argparse.Namespace, env, path: Path) -> bool:
    from .transport_bench import render, run

    report = run(_layers(args.layers), args.tokens, args.requests, args.device, env, path)
    _show(render(report))
    return any("error" in layer for layer in report["layers"].values())


def _service_json(args: argparse.Namespace, env, path: Path) -> bool:
    from .json_bench import render, run

    _show(render(run(args.repeats, env, path)))
    return False


def _service_channel(args: argparse.Namespace, env, path: Path) -> bool:
    from .channel_bench import ChannelLoad, render, run
    from .shapes import SHAPES

    loads = [
        ChannelLoad(
            args.front_ends,
            clients,
            args.duration,
            args.tokens,
            SHAPES[layer].hidden_size,
            args.loop,
        )
        for layer in _layers(args.layers, demo=False)
        for clients in args.clients
    ]
    _show(render(run(loads, env, path)))
    return False


def _service_front_end(args: argparse.Namespace, env, path: Path) -> bool:
    from .channel_bench import FrontEndLoad, render_front_end, run_front_end
    from .shapes import SHAPES

    (layer,) = _layers(args.layers, demo=False)
    load = FrontEndLoad(args.tokens, SHAPES[layer].hidden_size, args.duration)
    _show(render_front_end(run_front_end(load, env, path)))
    return False


def _service_path(args: argparse.Namespace, env, path: Path) -> bool:
    from .request_path import render, run

    layers = _layers(args.layers)
    _show(render(run(layers, args.tokens, args.shared_intermediate, args.front_ends, env, path)))
    return False


def _service_timeline(args: argparse.Namespace, env, path: Path) -> bool:
    from .request_timeline import render, run

    body = "json" if args.json else "binary"
    layers = _layers(args.layers)
    shared = args.shared_intermediate
    _show(render(run(layers, args.tokens, args.requests, body, shared, env, path)))
    return False


def _service_weights(args: argparse.Namespace, env, path: Path) -> bool:
    from .weight_loading import render, run

    _show(render(run(args.repeats, env, path)))
    return False


def _layers(names: list[str], demo: bool = True) -> list[str]:
    """`names`, each the demo layer (where `demo`) or a shape of bench/shapes.py."""
    from .shapes import SHAPES

    unknown = [n for n in names if n not in SHAPES and not (demo and n == "demo")]
    if unknown:
        known = ("demo, " if demo else "") + ", ".join(SHAPES)
        raise ValueError(f"unknown layers {unknown}: {known}")
    return names


_SERVICE_MODES = {
    "load": _service_load,
    "http": _service_http,
    "transport": _service_transport,
    "json": _service_json,
    "channel": _service_channel,
    "front-end": _service_front_end,
    "path": _service_path,
    "timeline": _service_timeline,
    "weights": _service_weights,
}


def _add_service(sub: argparse._SubParsersAction) -> None:
    modes = {
        "load": "serve the demo and a DeepSeek-V3-sized layer (one process and behind front "
        "ends), load each at every concurrency level with hey (or Python clients), one client "
        "with 1-token and JSON bodies, batching off and uvicorn's pure-Python stack on the demo "
        "layer, the load generator's own capacity; every level against the bare forward, "
        "with GET /health and /v2/health/ready timed from a side process while it runs",
        "http": "load a running server (--url) and report throughput, latency and its own "
        "forward time",
        "transport": "one request at a time through each KServe transport (binary HTTP, gRPC, "
        "system and CUDA shared memory) against the server's forward",
        "json": "a JSON forward's numbers read and printed on the host and on a GPU",
        "channel": "the engine's end of the front ends' channel under load, on the CPU",
        "front-end": "one client through one HTTP front end to a stub engine, against the "
        "echo server, on the CPU: each process's CPU time per request and the latency",
        "path": "one request at a time, each level of the server's path timed alone",
        "timeline": "one request at a time, laid out from the spans the service records",
        "weights": "loading a DeepSeek-V3-sized layer onto the GPU, cold and warm",
    }
    c = Command(
        sub,
        "service",
        "benchmark the service as deployed",
        "Benchmark the service as deployed: servers in their own processes, clients in others.",
        modes,
        run_service,
    )
    served = ("load", "transport", "path", "timeline")
    c.add(
        "--layers",
        "comma list: demo or layer shapes of bench/shapes.py",
        {mode: ["deepseek-v3", "demo"] for mode in served}
        | {"http": ["demo"], "channel": ["deepseek-v3"], "front-end": ["deepseek-v3"]},
        type=name_list,
    )
    c.add("--url", "the server", {"http": "http://127.0.0.1:8000"})
    c.add(
        "--clients",
        "comma list of concurrency levels (channel: forwards in flight)",
        {"load": [1, 16, 64, 256], "http": [1, 16, 64, 256], "channel": [64]},
        type=int_list,
    )
    c.add(
        "--tokens",
        "tokens per request (path, timeline, front-end: 1 and this many)",
        dict.fromkeys((*served, "http", "channel", "front-end"), 64),
        type=int,
    )
    c.add(
        "--duration",
        "seconds per level (front-end: per request and server)",
        {"load": 4.0, "http": 20.0, "channel": 5.0, "front-end": 3.0},
        type=float,
    )
    c.add("--device", "the servers' --device", {"load": "auto", "transport": "auto"})
    c.add("--backend", "the servers' --backend", {"load": "triton"})
    c.add(
        "--shared-intermediate",
        "the shared expert of random layers",
        dict.fromkeys(("load", "path", "timeline"), 2048),
        type=int,
    )
    c.add("--max-batch-tokens", "the servers' batch size", {"load": 1024}, type=int)
    c.add("--budget-s", "no part starts after this many seconds", {"load": 480.0}, type=float)
    c.add("--generator", "auto (hey if on PATH), hey or python", {"load": "auto"})
    c.add(
        "--no-stack-variant",
        "skip the demo layer on uvicorn's h11 parser and asyncio loop",
        {"load": False},
        action="store_true",
    )
    c.add(
        "--front-ends",
        "front-end processes (load: each layer also behind them, 0: not)",
        {"load": 8, "path": 8, "channel": 4},
        type=int,
    )
    c.add(
        "--no-one-process",
        "serve each layer only behind the front ends: no one-process variant",
        {"load": False},
        action="store_true",
    )
    c.add("--max-requests", "per concurrency level", {"http": 100_000}, type=int)
    c.add("--timeout", "seconds per request", {"http": 30.0}, type=float)
    c.add(
        "--processes",
        "client processes the clients are spread over (one Python process tops "
        "out at a few thousand requests per second)",
        {"http": max(1, min(8, (os.cpu_count() or 2) // 2))},
        type=int,
    )
    c.add(
        "--json",
        "send JSON bodies instead of safetensors",
        {"http": False, "timeline": False},
        action="store_true",
    )
    c.add(
        "--requests",
        "timed requests per transport (timeline: per token count)",
        {"transport": 300, "timeline": 200},
        type=int,
    )
    c.add(
        "--loop",
        "the event loop: uvloop or asyncio",
        {"channel": "uvloop"},
        choices=("uvloop", "asyncio"),
    )
    c.add(
        "--repeats", "calls per figure (weights: warm loads)", {"json": 15, "weights": 3}, type=int
    )
    _common(c)


# ---- ep --------------------------------------------------------------------------------------


def run_ep(args: argparse.Namespace) -> int:
    _setup_logging()
    import torch

    from .environment import capture
    from .ep_service import EpBenchConfig, render, run
    from .schema import result_path

    config = EpBenchConfig(
        shape=_layers([args.shape], demo=False)[0],
        tokens=tuple(args.tokens),
        ep=args.ep,
        backend=args.backend,
        redundant=args.redundant,
        placement=args.placement,
        device=args.device,
        seconds=args.duration,
        inputs=tuple(args.inputs),
        profile=args.profile,
    )
    env = capture(torch.device(args.device), args.commit, args.command, gpus=args.ep)
    path = result_path(args.out, env, f"ep{args.ep}")
    _show(render(run(config, env, path)))
    log.info("wrote %s", path)
    return 0


def _add_ep(sub: argparse._SubParsersAction) -> None:
    c = Command(
        sub,
        "ep",
        "expert parallelism as served against one GPU",
        "Expert parallelism as `serve --ep N` runs it (without HTTP) against one GPU "
        "running the same backend: throughput, forward time and outputs at each token "
        "count.",
        {"ep": ""},
        run_ep,
    )
    c.add("--shape", "a layer shape of bench/shapes.py", {"ep": "deepseek-v3"})
    c.add("--tokens", "comma list of batch sizes", {"ep": [64, 512, 4096]}, type=int_list)
    c.add("--ep", "ranks", {"ep": 2}, type=int)
    c.add("--backend", "experts backend of both engines", {"ep": "auto"})
    c.add("--redundant", "--ep-redundant for the EP engine", {"ep": 0}, type=int)
    c.add(
        "--placement",
        "--ep-placement for the EP engine (JSON: experts per rank, e.g. "
        "bench/placements/deepseek-v3-ep2-116-140.json; default even slices)",
        {"ep": None},
        type=Path,
    )
    c.add("--device", "cuda; cpu (gloo) only checks the benchmark", {"ep": "cuda"})
    c.add("--duration", "seconds per point", {"ep": 3.0}, type=float)
    c.add(
        "--inputs",
        "comma list: pageable (rows in plain host memory), pinned (in pinned "
        "memory, outputs into pinned memory, as binary requests); cpu: pageable only",
        {"ep": ["pageable", "pinned"]},
        type=name_list,
    )
    c.add(
        "--profile",
        "also rank 0's and every rank's GPU kernels at the largest M, and the "
        "ranks' forwards side by side",
        {"ep": False},
        action="store_true",
    )
    _common(c)


# ---- tune ------------------------------------------------------------------------------------


def run_tune(args: argparse.Namespace) -> int:
    _setup_logging()
    try:
        if args.mode == "rules":
            return _rules(args)
        if args.mode == "calibrate":
            return _calibrate(args)
        if args.shape is None:
            raise ValueError("--mode tiles needs --shape")
        from .tune import run_tune as tune

        out = tune(args.shape, args.scheme, tuple(args.tokens), args.tuned, args.retune)
    except ValueError as err:
        log.error("%s", err)
        return 2
    log.info("wrote %s", out)
    return 0


def _rules(args: argparse.Namespace) -> int:
    import json

    from pydantic import ValidationError

    from .auto_table import default_path, merged, rule_table, write_table
    from .kernel_bench import read_run

    if args.source is None:
        raise ValueError("--mode rules needs --from, a `moe-serve bench kernels` result")
    try:
        run = read_run(args.source)
    except (OSError, ValidationError) as err:
        raise ValueError(f"cannot read {args.source} as a kernel benchmark result: {err}") from err
    out = args.tuned or default_path(run)
    try:
        table = rule_table(run)
        if args.merge and out.exists():
            table = merged(table, json.loads(out.read_text()))
    except ValueError as err:
        raise ValueError(f"{args.source}: {err}") from err
    write_table(table, out)
    for key, rule in table["rules"].items():
        log.info("%s (%s): %s", key, rule["shape"], ", ".join(rule["order"]))
    log.info("wrote %s and %s", out, out.with_suffix(".md"))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from .calibration import calibrate_shapes

    if not torch.cuda.is_available():
        raise ValueError("--mode calibrate measures on a GPU: none is visible")
    device = torch.device("cuda", torch.cuda.current_device())
    _show(calibrate_shapes(args.shapes, args.max_batch_tokens, args.budget_s, device))
    return 0


def _add_tune(sub: argparse._SubParsersAction) -> None:
    modes = {
        "tiles": "search Triton tile sizes for a layer on this GPU, one token-count bucket at a "
        "time, and write the best to the tuned file the triton backend reads (resumes: buckets "
        "already there are kept)",
        "rules": "write the rule table --backend auto follows (per layer shape, each backend's "
        "median as served at each token count and which backend auto runs where) from a "
        "`bench kernels` result, with its markdown summary beside it",
        "calibrate": "run the service's self-calibration (serve --calibrate) on random layers "
        "of --shapes and print the time it took and its rules beside this GPU's tuned table "
        "(nothing is written)",
    }
    c = Command(
        sub,
        "tune",
        "tile sizes and auto's rules for this GPU",
        "Tune what the kernels read on this GPU: Triton tile sizes, auto's rule table.",
        modes,
        run_tune,
    )
    c.add(
        "--shape",
        "mixtral, mixtral-fp8, qwen3, deepseek-v3, gpt-oss, or E,H,I,top_k",
        {"tiles": None},
        type=_tune_shape,
    )
    c.add(
        "--scheme",
        "quantisation scheme of kernels/quant_scheme.py (default: the shape's)",
        {"tiles": None},
        type=_scheme,
    )
    c.add(
        "--tokens",
        "token-count buckets, comma list",
        {"tiles": [1, 16, 64, 512, 4096]},
        type=int_list,
    )
    c.add(
        "--retune",
        "search the --tokens buckets again even where the file has them (their "
        "current tiles compete); the file's other buckets are kept",
        {"tiles": False},
        action="store_true",
    )
    c.add(
        "--from",
        "a `moe-serve bench kernels` result with the uniform load",
        {"rules": None},
        type=Path,
        dest="source",
        metavar="RESULT",
    )
    c.add(
        "--merge",
        "keep the rules of the table already there that this run does not measure "
        "(each rule then names the commit it was measured at)",
        {"rules": False},
        action="store_true",
    )
    c.add(
        "--shapes",
        "layer shapes of bench/shapes.py, comma list",
        {"calibrate": ["deepseek-v3", "mixtral"]},
        type=_shapes,
    )
    c.add(
        "--max-batch-tokens",
        "as serve's: the graph buckets calibrated are those of this many tokens",
        {"calibrate": 1024},
        type=int,
        metavar="N",
    )
    c.add(
        "--budget-s",
        "as serve's --calibrate-budget-s: seconds one layer's calibration may take",
        {"calibrate": 60.0},
        type=float,
        metavar="S",
    )
    c.add(
        "--out",
        "the tuned file (tiles default: kernels/tuned/<key>.json; rules: "
        "kernels/tuned/auto_<gpu>.json, its .md beside it)",
        {"tiles": None, "rules": None},
        type=Path,
        dest="tuned",
        metavar="FILE",
    )


# ---- report ----------------------------------------------------------------------------------


def run_report(args: argparse.Namespace) -> int:
    _setup_logging()
    if args.mode == "pages":
        from .report import write_pages

        for path in write_pages(args.results, args.page):
            log.info("wrote %s", path)
        return 0
    from pydantic import ValidationError

    from .kernel_bench import read_run

    if args.file is None:
        log.error("--mode %s needs FILE, a `moe-serve bench kernels` result", args.mode)
        return 2
    try:
        run = read_run(args.file)
    except (OSError, ValidationError) as err:
        log.error("cannot read %s as a kernel benchmark result: %s", args.file, err)
        return 2
    if args.mode == "summary":
        from .summary import render

        _show(render(run))
        return 0
    try:  # matplotlib is the optional `bench` extra
        from .plot import plot_run
    except ImportError as err:
        log.error("plotting needs matplotlib (pip install -e '.[bench]'): %s", err)
        return 2
    for path in plot_run(run, args.file):
        log.info("wrote %s", path)
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    modes = {
        "pages": "write docs/performance.md (a current table per GPU, each row with its device, "
        "date and commit, and how each figure is measured) and the results index "
        "bench/results/README.md from the stored results",
        "summary": "print a kernel result FILE as markdown tables",
        "plot": "draw time and roofline PNGs beside a kernel result FILE (matplotlib)",
    }
    c = Command(
        sub,
        "report",
        "the performance page and results index from the stored results",
        "Pages and tables from stored results: nothing is measured.",
        modes,
        run_report,
    )
    c.add(
        "file",
        "a `moe-serve bench kernels` result",
        {"summary": None, "plot": None},
        type=Path,
        nargs="?",
    )
    c.add("--results", "the stored results", {"pages": RESULTS}, type=Path, metavar="DIR")
    c.add(
        "--page",
        "the performance page to write",
        {"pages": PERFORMANCE_PAGE},
        type=Path,
        metavar="FILE",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        description="Benchmarks (kernels, the service, expert parallelism), tuning for this GPU, "
        "and the performance page made from the stored results (bench/results, "
        "docs/performance.md).",
    )
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for add in (_add_kernels, _add_service, _add_ep, _add_tune, _add_report):
        add(sub)
