"""Expert parallelism in service mode against one GPU, without HTTP: `moe-serve bench ep`.

Writes a random layer of the shape (router and DeepSeek-V3's shared expert included) as a layer
directory in a temporary directory, then for each engine, one after the other on the same GPUs:
- "1 GPU": service.engine.engine.Engine on cuda:0 (pipelined, CUDA graphs), as `serve` runs it;
- "EP N": service.ep.engine.EPEngine over cuda:0..N-1, as `serve --ep N` runs it (rank 0 brings
  every batch; the others replay the same graph bucket);
each warmed up at every token count, then fed batches of M tokens (bf16 on the host, as the
batcher hands them over: in plain memory, or pinned with the outputs copied into pinned memory
as for binary requests) for about SECONDS_PER_POINT, up to the engine's batches in flight.
Throughput is tokens per second of wall time from `start` to each result on the host; "forward
ms" is the median of a batch's forward on rank 0's compute stream (CUDA events; the collectives'
waits for the other ranks included; not EP's prologue and epilogue, which run on the copy
streams: service/engine/pipeline.py); the rest of a batch's time is the host's and the copies'.
The EP outputs are compared with one GPU's (same backend; only the summation order differs), the
first batch's routing must be the same, and every batch's routing ids must be experts' ids
("bad routing batches" counts those the engine refused for that:
service.engine.pipeline.BadRouting), and UNLIKE_BATCHES batches in flight are compared bit for bit
with the same rows run alone.

The result holds every figure, its .md the table with the targets. With `profile`, in a folder
beside them (DIR): DIR/profile-1gpu.txt and DIR/profile-ep.txt, rank 0's GPU kernels (those
replayed from the graphs included) over PROFILED_BATCHES batches of the largest M, by total
time: where a forward's time goes (the collectives' kernels include their waits for the
other ranks); DIR/profile-ep-rank{r}.txt, the same forwards on each other rank; beside each its
Chrome trace (`.trace.json`); and DIR/ep-timeline.md, the ranks' forwards side by side
(bench/ep_timeline.py).
"""

from __future__ import annotations

import collections
import json
import logging
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels.accuracy import relative_error
from ..kernels.tensors import ForwardInputs
from ..service.engine.engine import Engine
from ..service.engine.pipeline import BadRouting
from ..service.engine.profiling import kernel_profiler, write_profile
from ..service.ep.engine import EPEngine
from ..service.ep.group import leave
from ..service.settings import Settings
from ..weights.load import load_layer
from ..weights.manifest import Manifest, Source
from ..weights.write import write_layer
from .ep_timeline import write_ep_timeline
from .random_layer import random_layer
from .schema import Environment, write_result
from .shapes import SHAPES

log = logging.getLogger(__name__)

SECONDS_PER_POINT = 3.0
TARGETS = {4096: 1.8, 512: 1.5, 64: 1.0}  # EP throughput over one GPU's, at M tokens
UNLIKE_BATCHES = 12  # batches in flight compared with the same rows run alone, per point
SHARED_INTERMEDIATE = 2048  # DeepSeek-V3's shared expert
PROFILED_BATCHES = 10


def write_random_layer(shape: str, out: Path, device: torch.device) -> Path:
    cfg = SHAPES[shape]
    shared = min(SHARED_INTERMEDIATE, cfg.intermediate_size)
    weights = random_layer(cfg, device, router=True, shared_intermediate=shared)
    source = Source(family="bench", model=f"random-{shape}", layer=0)
    manifest = Manifest.from_config(cfg, weights, name=shape, source=source)
    path = out / "layers" / shape
    write_layer(path, weights, manifest)
    return path


def _inputs(m: int, hidden: int, pinned: bool, count: int = 4) -> list[ForwardInputs]:
    gen = torch.Generator().manual_seed(m)
    rows = [torch.randn(m, hidden, generator=gen).to(torch.bfloat16) for _ in range(count)]
    return [ForwardInputs(r.pin_memory() if pinned else r) for r in rows]


def throughput(
    engine: Engine, name: str, m: int, hidden: int, seconds: float, pinned: bool
) -> dict:
    """Tokens per second over about `seconds`, up to max_in_flight batches at once, each
    waited for on a completer thread as service.engine.batcher does. `pinned`: rows in pinned
    memory and outputs copied into pinned memory, as binary requests are read and answered
    (service/http/forward_body.py); else plain host tensors in and the output copied out of the
    slot."""
    batches = _inputs(m, hidden, pinned)
    first = engine.start(name, [batches[0]]).result().outputs[0]
    # an output buffer per batch in flight, and one for the batch being started
    outputs = [
        torch.empty(m, hidden, dtype=torch.bfloat16, pin_memory=True) if pinned else None
        for _ in range(engine.max_in_flight + 1)
    ]
    pending: collections.deque = collections.deque()
    sent = done = 0
    forward_s, stage_s = [], []
    bad_routing = 0  # batches refused for routing ids that name no expert (service.engine.pipeline)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="complete") as completer:
        started = time.perf_counter()
        while (feeding := time.perf_counter() - started < seconds) or pending:
            if feeding and len(pending) < engine.max_in_flight:
                into = [outputs[sent % len(outputs)]]
                batch = engine.start(name, [batches[sent % len(batches)]], into)
                pending.append(completer.submit(batch.result))
                sent += 1
                continue
            try:
                times = pending.popleft().result().times
            except BadRouting:
                bad_routing += 1
                continue
            forward_s.append(times.forward_s)
            stage_s.append(times.stage_s)
            done += 1
        elapsed = time.perf_counter() - started
    if not done:
        raise RuntimeError(f"M={m}: all {bad_routing} batches came back with bad routing")
    return {
        "M": m,
        "inputs": "pinned" if pinned else "pageable",
        "batches": done,
        "ms_per_batch": elapsed / done * 1e3,
        "tokens_per_s": done * m / elapsed,
        # rank 0's compute stream, from CUDA events (collectives' waits included)
        "forward_ms_p50": statistics.median(forward_s) * 1e3,
        "stage_ms_p50": statistics.median(stage_s) * 1e3,  # host: the batch into pinned memory
        "bad_routing_batches": bad_routing,
        "first_output": first.output.float(),
        "first_ids": first.routing.topk_ids,
    }


def unlike_alone(engine: Engine, name: str, m: int, hidden: int) -> int:
    """How many of UNLIKE_BATCHES batches, kept in flight as the throughput runs keep them, came
    back with an output that differs in any bit from the same rows run alone: a batch's work
    read or overwritten by another's in flight (a prologue running beside the previous
    forward, shared buffers) shows here. Each backend's forward is deterministic."""
    batches = _inputs(m, hidden, pinned=False)
    alone = [engine.start(name, [rows]).result().outputs[0].output for rows in batches]
    unlike = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="complete") as completer:
        pending: collections.deque = collections.deque()
        for i in range(UNLIKE_BATCHES):
            if len(pending) == engine.max_in_flight:
                j, batch = pending.popleft()
                unlike += not torch.equal(batch.result().outputs[0].output, alone[j])
            j = i % len(batches)
            pending.append((j, completer.submit(engine.start(name, [batches[j]]).result)))
        for j, batch in pending:
            unlike += not torch.equal(batch.result().outputs[0].output, alone[j])
    return unlike


def profile_kernels(engine: Engine, name: str, m: int, hidden: int, path: Path) -> None:
    """Rank 0's GPU kernels over PROFILED_BATCHES batches of `m` pinned rows, kept in flight as
    the throughput runs keep them, by total time -> `path` and its Chrome trace beside it; an
    EP engine's other ranks write theirs beside it (`profile-ep-rank{r}.txt`, on their own
    host), over one batch more: the one rank 0 runs unprofiled while they start profiling."""
    device = engine.get(name).device
    on_gpu = device.type == "cuda"
    inputs = _inputs(m, hidden, pinned=on_gpu, count=1)
    engine.start(name, inputs).result()
    header = f"{PROFILED_BATCHES} batches of M={m} on {type(engine).__name__}"
    ranks = isinstance(engine, EPEngine)
    if ranks:
        engine.start_rank_profiles()
        # ends once every rank has run it, so has started its profiler (which takes seconds):
        # rank 0's profile then holds no wait for that
        engine.start(name, inputs).result()
    with kernel_profiler(device) as prof, ThreadPoolExecutor(1) as completer:
        pending: collections.deque = collections.deque()
        for _ in range(PROFILED_BATCHES):
            if len(pending) == engine.max_in_flight:
                pending.popleft().result()
            pending.append(completer.submit(engine.start(name, inputs).result))
        for batch in pending:
            batch.result()
    if ranks:
        engine.stop_rank_profiles(path.parent / "profile-ep-rank{rank}.txt", f"{header} (+1)")
    write_profile(prof, device, header, path)


def run_engine(
    engine: Engine,
    name: str,
    tokens: list[int],
    hidden: int,
    seconds: float,
    kinds: list[bool],
) -> list[dict]:
    """A row per kind of inputs (pinned or not) and token count."""
    engine.warm_up(tokens)
    rows = []
    for pinned in kinds:
        for m in tokens:
            row = throughput(engine, name, m, hidden, seconds, pinned)
            row["unlike_alone"] = unlike_alone(engine, name, m, hidden)
            rows.append(row)
            log.info(
                "%s %s M=%d: %.0f tokens/s",
                type(engine).__name__,
                row["inputs"],
                m,
                row["tokens_per_s"],
            )
    return rows


@dataclass(frozen=True)
class EpBenchConfig:
    shape: str = "deepseek-v3"
    tokens: tuple[int, ...] = (64, 512, 4096)
    ep: int = 2
    backend: str = "auto"
    redundant: int = 0  # --ep-redundant for the EP engine
    placement: Path | None = None  # --ep-placement for the EP engine; None: even slices
    device: str = "cuda"  # cpu (gloo) only checks the benchmark
    seconds: float = SECONDS_PER_POINT  # per point
    inputs: tuple[str, ...] = ("pageable", "pinned")  # cpu: pageable only
    profile: bool = False


def report(
    config: EpBenchConfig,
    env: Environment,
    backend: str,
    one_gpu: list[dict],
    ep_rows: list[dict],
    balance: float,
) -> dict:
    """The result: every figure of both engines, point by point."""
    points = []
    for one, many in zip(one_gpu, ep_rows, strict=True):
        err = relative_error(many.pop("first_output"), one.pop("first_output"))
        same_routing = torch.equal(many.pop("first_ids"), one.pop("first_ids"))
        points.append({
            "one_gpu": one,
            "ep": many,
            "speedup": many["tokens_per_s"] / one["tokens_per_s"],
            "rel_err": err,
            "same_routing": same_routing,
        })  # fmt: skip
    placement = None if config.placement is None else json.loads(config.placement.read_text())
    return {
        "environment": env.model_dump(),
        "shape": config.shape,
        "ep": config.ep,
        "redundant": config.redundant,
        "placement": placement,
        "backend": backend,
        "last_balancedness": balance,
        "points": points,
    }


def render(result: dict) -> str:
    env = Environment.model_validate(result["environment"])
    table = [
        f"{result['shape']}, {result['backend']}, EP {result['ep']} vs 1 GPU ({env.device}, "
        f"commit {env.commit})",
        "",
        "inputs | M | 1 GPU tokens/s | EP tokens/s | speedup | target | ms/batch 1 GPU "
        "| ms/batch EP | forward ms 1 GPU | forward ms EP | rel err vs 1 GPU | same routing "
        "| bad routing batches 1 GPU / EP | in flight unlike alone 1 GPU / EP",
        "--- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | ---",
    ]
    for point in result["points"]:
        one, many, speedup = point["one_gpu"], point["ep"], point["speedup"]
        target = TARGETS.get(one["M"])
        verdict = (
            "" if target is None else f">= {target} {'met' if speedup >= target else 'MISSED'}"
        )
        table.append(
            f"{one['inputs']} | {one['M']} | {one['tokens_per_s']:.0f} | "
            f"{many['tokens_per_s']:.0f} | {speedup:.2f}x | "
            f"{verdict} | {one['ms_per_batch']:.2f} | {many['ms_per_batch']:.2f} | "
            f"{one['forward_ms_p50']:.2f} | {many['forward_ms_p50']:.2f} | {point['rel_err']:.1e} "
            f"| {'yes' if point['same_routing'] else 'NO'} | "
            f"{one['bad_routing_batches']} / {many['bad_routing_batches']} | "
            f"{one['unlike_alone']} / {many['unlike_alone']} of {UNLIKE_BATCHES}"
        )
    return "\n".join(table) + "\n"


def run(config: EpBenchConfig, env: Environment, path: Path) -> dict:
    """One GPU, then EP over `config.ep`; writes `path` and its .md (profiles beside them)."""
    tokens = list(config.tokens)
    cuda = config.device == "cuda"
    kinds = [kind == "pinned" for kind in config.inputs if cuda or kind == "pageable"]
    device = torch.device(config.device, 0) if config.device == "cuda" else torch.device("cpu")
    hidden = SHAPES[config.shape].hidden_size
    top = max(tokens)
    profiles = path.with_suffix("")
    if config.profile:
        profiles.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="moe-serve-ep-bench-") as work:
        layer = write_random_layer(config.shape, Path(work), device)
        single = Engine([device], config.backend, top)
        served = single.add(load_layer(layer, device))
        one_gpu = run_engine(single, config.shape, tokens, hidden, config.seconds, kinds)
        if config.profile:
            profile_kernels(single, config.shape, top, hidden, profiles / "profile-1gpu.txt")
        backend = served.backend  # what auto chose on one GPU, for the report
        del single, served
        if device.type == "cuda":
            torch.cuda.empty_cache()

        settings = Settings(
            device=config.device,
            ep=config.ep,
            ep_redundant=config.redundant,
            ep_placement=config.placement,
            weights=(layer,),
            backend=config.backend,  # as `serve --ep N --backend B` hands it to the ranks
            max_batch_tokens=top,
        )
        ep = EPEngine(settings, [layer])
        try:
            for source in ep.load():
                ep.add(source)
            ep_rows = run_engine(ep, config.shape, tokens, hidden, config.seconds, kinds)
            if config.profile:
                profile_kernels(ep, config.shape, top, hidden, profiles / "profile-ep.txt")
            balance = ep.placement(config.shape)["balancedness"]
            result = report(config, env, backend, one_gpu, ep_rows, balance)  # before any close
        finally:
            closing = time.perf_counter()
            ep.close()
            log.info("EPEngine.close took %.1f s", time.perf_counter() - closing)
    if config.profile:
        try:
            write_ep_timeline(profiles)
        except ValueError as err:  # no collectives in the traces (gloo on a CPU)
            log.warning("no timeline of the ranks: %s", err)
    write_result(path, result, render(result))
    if device.type == "cuda":
        leave(0)  # NCCL's abort of the group at the interpreter's exit waits 60 s, then hangs
    return result
