"""`moe-serve bench report` (`--mode pages`): docs/performance.md and bench/results/README.md,
made from the stored results alone, so that running it again on the same results writes the same
files byte for byte (a test checks the committed page against the results).

Every result is bench/results/<gpu>/<bench>-<date>-<commit>.json with its `environment`
(bench/schema.py). The performance page holds, per GPU, one table per benchmark whose rows come
from the newest result that measured each row (a kernel table's row is a layer shape at a token
count; a service table's, a layer, serving mode, body and concurrency): every row names the
device, date and commit it was measured on. Above the tables, how each figure is measured. The
index lists every stored result with its provenance and the command that makes it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .schema import AUTO_ROW, BenchRun, Environment, gpu_name

INDEX = "README.md"
Row = tuple[tuple, list[str]]  # (the row's key: what it measures, its cells)


@dataclass(frozen=True)
class Stored:
    """One stored result."""

    path: Path  # relative to the results folder
    bench: str  # the name before -<date>-<commit>: kernels, kernels-gpt-oss, service, ep2, ...
    env: Environment
    data: dict

    @property
    def kind(self) -> str:
        """Which benchmark wrote it: a key of TABLES or of NAMES."""
        if re.fullmatch(r"ep\d+", self.bench):
            return "ep"
        named = sorted(NAMES, key=len, reverse=True)
        return next((k for k in named if f"{self.bench}-".startswith(f"{k}-")), self.bench)

    @property
    def gpu(self) -> str:
        return self.path.parts[0]


def load(results: Path) -> list[Stored]:
    """Every result under `results`, oldest first; ValueError where a name disagrees with the
    result's environment (its GPU folder, date or commit)."""
    found = []
    for path in sorted(results.glob("*/*.json")):
        data = json.loads(path.read_text())
        env = Environment.model_validate(data["environment"])
        tail = f"-{env.date()}-{env.commit}.json"
        where = path.relative_to(results)
        if not path.name.endswith(tail) or path.parent.name != gpu_name(env.device):
            expected = f"{gpu_name(env.device)}/<bench>{tail}"
            raise ValueError(f"{where}: its environment names it {expected}")
        found.append(Stored(where, path.name.removesuffix(tail), env, data))
    return sorted(found, key=lambda s: (s.env.created, str(s.path)))


def _provenance(env: Environment) -> list[str]:
    device = env.device if env.gpus == 1 else f"{env.gpus} x {env.device}"
    return [device, env.date(), env.commit]


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


# ---- rows of each benchmark's table: (key, cells), cells without the provenance --------------


def _kernel_rows(stored: Stored) -> Iterable[Row]:
    run = BenchRun.model_validate(stored.data)
    autos = {shape.name: shape.auto for shape in run.shapes}
    for p in run.points:
        if p.load != "uniform":
            continue
        results = {r.backend: r for r in p.results if r.correct}
        best = results.get(p.best_served) if p.best_served else None
        best_us = best.served().median_us if best else None
        auto = results.get(AUTO_ROW) or results.get(autos[p.shape] or "")
        auto_us = auto.served().median_us if auto and auto.served() else None
        ratio = p.auto_served_ratio
        if ratio is None and auto_us is not None and best_us is not None:
            ratio = auto_us / best_us
        yield (
            (p.shape, p.tokens),
            [
                p.shape,
                str(p.tokens),
                autos[p.shape] or "-",
                _us(auto_us),
                "-" if best is None else best.backend + ("*" if best.captured else ""),
                _us(best_us),
                "-" if ratio is None else f"{ratio:.3f}",
                "-" if p.auto_beside_ratio is None else f"{p.auto_beside_ratio:.3f}",
                "-" if best_us is None else _pct(p.roofline_us / best_us),
            ],
        )


def _external_rows(stored: Stored) -> Iterable[Row]:
    for r in stored.data["rows"]:
        captured = r.get("captured_ratio")
        yield (
            (r["shape"], r["backend"], r["tokens"]),
            [
                r["shape"],
                r["backend"],
                str(r["tokens"]),
                _us(r["captured_us"]),
                _us(r["alone_captured_us"]),
                "-" if captured is None else f"{captured:.2f}",
                "-" if r.get("eager_ratio") is None else f"{r['eager_ratio']:.2f}",
            ],
        )


def _profile_rows(stored: Stored) -> Iterable[Row]:
    for run in stored.data["runs"]:
        for p in run["points"]:
            yield (
                (run["shape"], run["backend"], run["shared"], p["tokens"]),
                [
                    run["shape"],
                    run["backend"],
                    run["shared"],
                    str(p["tokens"]),
                    _us(p["replay_ms"] * 1e3),
                ],
            )


def _probe_ms(probe: dict | None) -> str:
    """p50/p99 of the answered probes, to the microsecond."""
    if probe is None:
        return "-"
    return "/".join("-" if v is None else f"{v:.3f}" for v in (probe["p50_ms"], probe["p99_ms"]))


def _service_rows(stored: Stored) -> Iterable[Row]:
    for run in stored.data["runs"]:
        variant = run["variant"]
        if variant != "default" and (variant.startswith("batching off") or
                                     not variant.endswith("front ends")):  # fmt: skip
            continue  # the variants run to show a cause (batching off, another HTTP stack)
        serving = "one process" if variant == "default" else variant
        for lv in run["levels"]:
            key = (lv["layer"], serving, lv["body"], lv["tokens"], lv["clients"])
            yield (
                key,
                [
                    lv["layer"],
                    serving,
                    lv["body"],
                    str(lv["tokens"]),
                    str(lv["clients"]),
                    _ms(lv["p50_ms"]),
                    _ms(lv["p99_ms"]),
                    f"{lv['requests_per_s']:,.0f}",
                    _ms(lv.get("bare_forward_ms")),
                    _pct(lv.get("gpu_busy")),
                    _pct(lv.get("tokens_per_s_vs_bare")),
                    _probe_ms(lv.get("probe")),
                ],
            )


def _transport_rows(stored: Stored) -> Iterable[Row]:
    for layer, result in stored.data["layers"].items():
        for name, f in result.get("transports", {}).items():
            forward = f["server_forward_ms"]
            yield (
                (layer, name),
                [
                    layer,
                    name,
                    _ms(f["p50_ms"]),
                    _ms(forward),
                    "-" if forward is None else _ms(f["p50_ms"] - forward),
                    "yes" if f["matches_http_binary"] else "NO",
                ],
            )


def _json_rows(stored: Stored) -> Iterable[Row]:
    for r in stored.data["rows"]:
        yield (
            (r["tokens"], r["hidden"]),
            [
                f"{r['tokens']} x {r['hidden']}",
                f"{r['body_bytes'] / 1e6:.2f}",
                _ms(r["read_host_ms"]),
                _ms(r["read_device_ms"]),
                _ms(r["print_host_ms"]),
                _ms(r["print_device_ms"]),
            ],
        )


def _ep_rows(stored: Stored) -> Iterable[Row]:
    d = stored.data
    placement = "even" if d["placement"] is None else "/".join(map(str, _sizes(d["placement"])))
    for p in d["points"]:
        one, ep = p["one_gpu"], p["ep"]
        key = (d["shape"], d["backend"], d["ep"], placement, one["inputs"], one["M"])
        yield (
            key,
            [
                d["shape"],
                d["backend"],
                str(d["ep"]),
                placement,
                one["inputs"],
                str(one["M"]),
                f"{one['tokens_per_s']:,.0f}",
                f"{ep['tokens_per_s']:,.0f}",
                f"{p['speedup']:.2f}x",
                _ms(one["forward_ms_p50"]),
                _ms(ep["forward_ms_p50"]),
            ],
        )


def _sizes(placement: dict) -> list[int]:
    """Experts per rank of a placement file's content."""
    return [len(experts) for experts in placement["ranks"]]


@dataclass(frozen=True)
class Table:
    title: str
    head: tuple[str, ...]
    rows: Callable[[Stored], Iterable[Row]]
    method: str  # how each figure is measured


TABLES: dict[str, Table] = {
    "kernels": Table(
        "Kernels: the whole layer as served",
        (
            "layer",
            "M",
            "auto runs",
            "auto us",
            "fastest",
            "us",
            "auto / fastest",
            "auto / its member beside it",
            "of roofline",
        ),
        _kernel_rows,
        "`moe-serve bench kernels`: each experts backend on a random layer of the shape (weights "
        "drawn and quantised on the GPU), M tokens, uniform router load (i.i.d. normal logits). "
        "The time is the whole layer as served, from router logits to the output, replayed from "
        "a CUDA graph of exactly M tokens where the backend captures (`*`), uncaptured where it "
        "cannot; CUDA events, the L2 flushed (twice its size written) before every iteration, "
        "the median of the iterations after warm-up calls. Every backend's output is "
        "checked against the float32 reference before it is timed; a wrong one is never the "
        "fastest. `auto runs` is what `--backend auto` builds for the layer on that GPU; auto "
        "is timed after every member, and where the run also timed it interleaved with the "
        "member it runs at that M (member, auto, auto, member, twice, the median of each's four "
        "timings: a timing's place in the run moves it by a few percent), `auto / its member "
        "beside it` is that comparison. The "
        "roofline is max(bytes that must move / copy bandwidth, FLOPs / dense GEMM peak), both "
        "ceilings measured in the same run; `of roofline` is the roofline over the fastest time.",
    ),
    "external-alone": Table(
        "External libraries: the backend against the library called alone",
        ("layer", "backend", "M", "captured us", "alone us", "ratio", "uncaptured ratio"),
        _external_rows,
        "`moe-serve bench kernels --mode external-alone`: each external backend's modular "
        "forward (prepare, experts, finalize; routing given) against its library called alone "
        "on the same inputs laid out beforehand (DeepGEMM's two grouped GEMMs; triton_kernels' "
        "two matmul_ogs calls), both captured in a CUDA graph and uncaptured, the L2 flushed, "
        "medians: the ratio is what the backend's glue costs.",
    ),
    "layer-profile": Table(
        "The layer as served, router and shared expert included",
        ("layer", "backend", "shared expert", "M", "replay us"),
        _profile_rows,
        "`moe-serve bench kernels --mode profile`: a random layer with its router and (DeepSeek-"
        "V3) its 2048-wide shared expert, captured whole in a CUDA graph as the service replays "
        "it, the median of its replays back to back (CUDA events, L2 not flushed).",
    ),
    "service": Table(
        "The service under load",
        (
            "layer",
            "serving",
            "body",
            "tokens",
            "clients",
            "p50 ms",
            "p99 ms",
            "req/s",
            "bare forward ms",
            "GPU busy",
            "tok/s of bare",
            "probe p50/p99 ms",
        ),
        _service_rows,
        "`moe-serve bench service`: the layer served as `moe-serve serve` runs it, in one "
        "process or behind front-end processes, loaded for seconds per level by hey (one "
        "process per request body, bodies differ) or by one client on a keep-alive connection; "
        "latencies are the client's. GPU busy is the forwards' device time (CUDA events) over "
        "the level's wall time; `bare forward` is the layer's own forward (graph replay, back "
        "to back) at each batch size the level formed, and `tok/s of bare` the served tokens "
        "per second over the bare forward's at those sizes. `probe` is GET /health and "
        "/v2/health/ready in turn, one every 10 ms while the level's load runs, from a process "
        "of its own on a keep-alive connection of its own (a raw socket: no HTTP library's "
        "time), timed from sending to the whole response.",
    ),
    "transport": Table(
        "KServe transports, one request at a time",
        ("layer", "transport", "p50 ms", "server forward ms", "p50 - forward ms", "same output"),
        _transport_rows,
        "`moe-serve bench service --mode transport`: sequential requests of 64 FP32 rows, each "
        "transport in turn after warm-up requests; the latency runs from sending a request to "
        "its reply (with shared memory the output is in the region by then); the server's "
        "forward is its own mean over the same requests; every output equals binary HTTP's.",
    ),
    "json": Table(
        "JSON numbers, host against GPU",
        (
            "tokens x H",
            "body MB",
            "read: host ms",
            "read: GPU ms",
            "print: host ms",
            "print: GPU ms",
        ),
        _json_rows,
        "`moe-serve bench service --mode json`: a forward's JSON body (bf16 values as Python "
        "floats through json.dumps) read and its reply printed on the host and on the GPU, "
        "each checked equal to the other byte for byte; medians of repeated calls, to the result "
        "in host memory.",
    ),
    "ep": Table(
        "Expert parallelism against one GPU",
        (
            "layer",
            "backend",
            "EP",
            "experts per rank",
            "inputs",
            "M",
            "1 GPU tok/s",
            "EP tok/s",
            "speedup",
            "forward ms 1 GPU",
            "forward ms EP",
        ),
        _ep_rows,
        "`moe-serve bench ep`: the engines `serve` and `serve --ep N` run, without HTTP, on a "
        "random layer with its router and shared expert, the same backend on both, fed batches "
        "of M tokens for seconds per point with batches in flight as the batcher keeps them; "
        "throughput is tokens per second of wall time, the forward rank 0's median on its "
        "compute stream (CUDA events, collectives' waits included).",
    ),
}
NAMES = {  # every benchmark that stores results: its command
    "kernels": "moe-serve bench kernels",
    "external-alone": "moe-serve bench kernels --mode external-alone",
    "layer-profile": "moe-serve bench kernels --mode profile",
    "service": "moe-serve bench service",
    "http": "moe-serve bench service --mode http",
    "transport": "moe-serve bench service --mode transport",
    "json": "moe-serve bench service --mode json",
    "channel": "moe-serve bench service --mode channel",
    "request-path": "moe-serve bench service --mode path",
    "request-timeline": "moe-serve bench service --mode timeline",
    "weight-loading": "moe-serve bench service --mode weights",
    "ep": "moe-serve bench ep",
}


def _markdown(head: Iterable[str], rows: Iterable[list[str]]) -> list[str]:
    head = list(head)
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def _current(stored: list[Stored], table: Table) -> list[list[str]]:
    """Each row from the newest result that measured it (`stored` is oldest first), by key."""
    latest: dict[tuple, list[str]] = {}
    for result in stored:
        for key, cells in table.rows(result):
            latest[key] = cells + _provenance(result.env)
    return [latest[key] for key in sorted(latest, key=_sortable)]


def _sortable(key: tuple) -> tuple:
    return tuple((0, v, "") if isinstance(v, int) else (1, 0, str(v)) for v in key)


def performance_page(stored: list[Stored]) -> str:
    gpus = sorted({s.gpu for s in stored if s.kind in TABLES}, reverse=True)
    kinds = [k for k in TABLES if any(s.kind == k for s in stored)]
    lines = [
        "# Performance",
        "",
        "Made by `moe-serve bench report` from the results stored in `bench/results` (listed in "
        "[bench/results/README.md](../bench/results/README.md)); every row names the device, "
        "date and commit it was measured on, and comes from the newest stored result that "
        "measured it. To change a figure, run the benchmark, store its result and run "
        "`moe-serve bench report` again.",
        "",
        "## How each figure is measured",
        "",
    ]
    lines += [f"- {TABLES[k].title}: {TABLES[k].method}" for k in kinds]
    for gpu in gpus:
        on_gpu = [s for s in stored if s.gpu == gpu]
        lines += ["", f"## {gpu.upper()}"]
        for kind in kinds:
            table = TABLES[kind]
            rows = _current([s for s in on_gpu if s.kind == kind], table)
            if rows:
                lines += ["", f"### {table.title}", ""]
                lines += _markdown((*table.head, "device", "date", "commit"), rows)
    return "\n".join(lines) + "\n"


def results_index(stored: list[Stored]) -> str:
    lines = [
        "# Stored benchmark results",
        "",
        "Made by `moe-serve bench report`, which also makes "
        "[docs/performance.md](../../docs/performance.md) from these files. Each result is "
        "`<gpu>/<bench>-<date>-<commit>.json`; its `environment` says where, when and from "
        "which commit it was measured, and the command that makes the run (bench/schema.py). "
        "A newer run of a benchmark replaces the file it supersedes: git keeps the rest.",
        "",
    ]
    rows = [
        [
            f"[{s.path}]({s.path})",
            NAMES.get(s.kind, s.kind),
            *_provenance(s.env),
            "-" if s.env.command is None else f"`{s.env.command}`",
        ]
        for s in sorted(stored, key=lambda s: (s.gpu, s.kind, s.env.created, str(s.path)))
    ]
    head = ("result", "benchmark", "device", "date", "commit", "command")
    return "\n".join(lines + _markdown(head, rows)) + "\n"


def write_pages(results: Path, page: Path) -> list[Path]:
    """The performance page at `page` and the index in `results`; the paths written."""
    stored = load(results)
    index = results / INDEX
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(performance_page(stored))
    index.write_text(results_index(stored))
    return [page, index]
