"""`moe-serve serve`: run the HTTP service (uvicorn) on the configured layers."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from types import FrameType

import uvicorn
from pydantic import ValidationError

from ..kernels.calibrate import DEFAULT_BUDGET_S, Mode
from ..kernels.registry import experts_backends
from ..kernels.selection import select
from ..weights.demo import demo_configs
from ..weights.errors import describe_validation_error
from ..weights.load import inspect_layer
from . import logs, tracing
from .core.runtime import Runtime
from .engine.devices import place_directories
from .ep.group import leave
from .ep.layers import initial_placement, rank_device
from .frontends.supervisor import FrontEnds
from .http.app import create_app
from .http.server import listen, server_config
from .interpreter import collect_less
from .settings import Settings

log = logging.getLogger(__name__)

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        description="Serve MoE layers over HTTP (JSON, safetensors and KServe v2; the API is at "
        "/docs). Every option also reads MOE_SERVE_<OPTION> (e.g. MOE_SERVE_PORT); an option "
        "given here wins. Without --weights the demo layers are generated into "
        "MOE_SERVE_CACHE_DIR and served. Exit status 2: refused before starting (the message "
        "says why); 1: the layers failed to load; 143 (killed by SIGTERM): a clean stop.",
    )
    # Defaults are None so that an option left out falls through to the environment/Settings.
    p.add_argument(
        "--weights", action="append", type=Path, metavar="DIR", help="layer to serve (repeatable)"
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="default 8000")
    p.add_argument("--grpc-port", type=int, help="KServe v2 over gRPC (default 8001; 0: off)")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="Prometheus /metrics on a port of its own (default 8002; 0: off; /metrics on "
        "--port stays)",
    )
    p.add_argument(
        "--http-workers",
        metavar="N|auto",
        help="HTTP front-end processes that share the port around the GPU process; 0: this "
        "process serves HTTP (default auto: none on the CPU or with --ep, on a GPU one per two "
        "usable CPU cores, at most 8; docs/serving.md, Which mode to run)",
    )
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument(
        "--devices",
        metavar="all|cuda:N,...",
        help="place whole layers over these GPUs by memory, the largest first (all: every "
        "visible GPU); default: every layer on --device",
    )
    p.add_argument(
        "--backend", help="experts backend for every layer (GET /backends lists them), or auto"
    )
    p.add_argument(
        "--max-batch-tokens", type=int, metavar="N", help="tokens per forward (default 1024)"
    )
    p.add_argument(
        "--max-batch-delay-ms",
        type=float,
        metavar="MS",
        help="how long a batch waits for more requests once the device is free (default 0)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        metavar="N",
        help="requests waiting per layer before 429 (default 256)",
    )
    p.add_argument("--ep", type=int, metavar="N", help="expert-parallel ranks, one GPU each")
    p.add_argument(
        "--ep-placement",
        type=Path,
        metavar="FILE",
        help="JSON: the experts each rank holds (an expert may sit on several)",
    )
    p.add_argument(
        "--ep-redundant",
        type=int,
        metavar="N",
        help="N extra copies of the hottest experts (by the placement file's counts), over the "
        "least loaded ranks; tokens split between copies (default 0)",
    )
    p.add_argument(
        "--ep-local-ranks",
        type=int,
        metavar="K",
        help="start ranks 0..K-1 here; the others join from other hosts with `moe-serve "
        "ep-rank` at MASTER_ADDR:MASTER_PORT (default: all --ep ranks here)",
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="the lowest level logged (default info)",
    )
    p.add_argument(
        "--log-format", choices=["text", "json"], help="json: one object per line (default text)"
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="where the demo layers are generated and calibrated rules cached (default "
        "~/.cache/moe-serve)",
    )
    p.add_argument(
        "--calibrate",
        choices=[mode.value for mode in Mode],
        help="time each layer's backends on this GPU at start-up for --backend auto: once "
        "(default: where no tuned rule table fits the layer and no rule is cached in "
        "CACHE_DIR/calibration), always (at each start), off (docs/backends.md)",
    )
    p.add_argument(
        "--calibrate-budget-s",
        type=float,
        metavar="S",
        help=f"seconds one layer's calibration may take (default {DEFAULT_BUDGET_S:g})",
    )
    p.add_argument(
        "--allow-shared-memory",
        action="store_true",
        default=None,
        help="let clients register system and CUDA shared-memory regions (default off)",
    )
    p.add_argument(
        "--shared-memory-prefix",
        metavar="PREFIX",
        help="accept only system shared-memory keys whose name starts with PREFIX (without "
        "it, a key may name any /dev/shm object this server's user can open)",
    )
    p.add_argument(
        "--model-repository",
        type=Path,
        metavar="DIR",
        help="serve every layer directory in DIR; load/unload them at run time",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="replay forwards from CUDA graphs where the backend allows (default on)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        default=None,
        help="make each row's output bit for bit independent of the rows it is batched with "
        "and of the chunking (reference and triton backends; refuses fp8-tensor layers and "
        "--ep; costs speed: docs/backends.md, Batch invariance)",
    )
    p.set_defaults(run=run)


GRPC_LISTENER = "gRPC, --grpc-port; 0 turns gRPC off"
METRICS_LISTENER = "metrics, --metrics-port; 0 turns the metrics port off"


def run(args: argparse.Namespace) -> int:
    given = {
        name: value
        for name, value in vars(args).items()
        if name in Settings.model_fields and value is not None
    }
    try:
        settings = Settings(**given)
        _check_layers(settings)
        listener = listen(settings.host, settings.port)
        if settings.grpc_port:  # gRPC binds in the app: refuse a port in use here, first
            listen(settings.host, settings.grpc_port, GRPC_LISTENER).close()
        if settings.metrics_port:
            listen(settings.host, settings.metrics_port, METRICS_LISTENER).close()
    except ValidationError as err:
        return _refuse(f"invalid settings: {describe_validation_error(err, 'settings')}")
    except ValueError as err:  # LayerFileError is a ValueError
        return _refuse(str(err))
    logs.configure(settings.log_level, settings.log_format)
    try:
        tracing.configure_from_environment()
    except (ValueError, ImportError) as err:
        return _refuse(f"tracing: {err}")
    if settings.api_token is None and settings.host not in LOOPBACK:
        log.warning("listening on %s with no MOE_SERVE_API_TOKEN: open to all", settings.host)
    if settings.front_ends():
        front_ends = FrontEnds(settings, listener)
        app = create_app(settings, front_ends=front_ends)
        config = server_config(app, settings, str(front_ends.http_path))
        server = _FrontedServer(config, app.state.runtime)
        server.front_ends = front_ends
        sockets = None  # the front ends listen; this process serves them on a Unix socket
    else:
        app = create_app(settings)
        server = _DrainingServer(server_config(app, settings), app.state.runtime)
        sockets = [listener]
    # a start that fails after the checks above (a layer's data, the device) ends the process
    app.state.runtime.on_start_failure = lambda: setattr(server, "should_exit", True)
    collect_less()
    server.run(sockets=sockets)
    status = 1 if app.state.runtime.start_failed else 0
    if settings.ep > 1 and settings.torch_device().type == "cuda":
        leave(status)  # past NCCL's abort of the groups at the interpreter's exit (it hangs)
    return status


class _DrainingServer(uvicorn.Server):
    """On SIGTERM the runtime starts draining at once, alongside uvicorn's HTTP: gRPC answers
    not ready and refuses new calls while its calls in flight finish."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.runtime.drain()
        super().handle_exit(sig, frame)


class _FrontedServer(_DrainingServer):
    """On SIGTERM the front ends start draining at once, alongside this process's server."""

    front_ends: FrontEnds

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.front_ends.terminate()
        super().handle_exit(sig, frame)


def _check_layers(settings: Settings) -> None:
    """Refuse here, naming the file or backend, what would otherwise never get ready."""
    devices = settings.layer_devices()  # refuses GPUs that are not there
    rank_device(devices[0], (settings.ep_local_ranks or settings.ep) - 1)  # a GPU for each rank
    backends = experts_backends()
    if settings.backend != "auto" and settings.backend not in backends:
        raise ValueError(f"unknown backend {settings.backend!r}; registered: {', '.join(backends)}")
    manifests = {str(path): inspect_layer(path) for path in settings.weights}
    named: dict[str, str] = {}
    for where, manifest in manifests.items():
        if manifest.name in named:
            raise ValueError(
                f"{named[manifest.name]} and {where} are both named {manifest.name!r}; "
                "layer names must be unique"
            )
        named[manifest.name] = where
    place_directories(settings.weights, devices)  # a layer no device has room for
    configs = {where: manifest.config for where, manifest in manifests.items()}
    for where, cfg in (configs or demo_configs()).items():
        try:
            select(cfg, devices[0], settings.backend, settings.ep > 1, settings.batch_invariant)
            if settings.ep > 1:
                initial_placement(settings, cfg.num_experts)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


def _refuse(message: str) -> int:
    logging.basicConfig(format="moe-serve serve: %(message)s")
    log.error("%s", message)
    return 2
