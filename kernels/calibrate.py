"""Self-calibration: `--backend auto`'s rule for one layer, measured on the GPU that serves it.

Where no tuned rule table fits a layer (kernels/tuned/auto_<gpu>.json has no rule for its
`<scheme>/<shape class>` on this GPU), the service times the layer's candidate backends at its
graph buckets (the token counts it captures CUDA graphs for) when it loads the layer, and
makes the rule from the times as the tuned tables are made (kernels/rules.py `make_rule`): a
rule table of one rule, in their form, which `select` then follows (`rules=`).

Measuring: the candidates are the backends that support the layer here, bar the exact
`reference*` (never the fastest on a GPU) and the composed `triton-or-deep-gemm` (never planned:
its members are), in auto's fixed order first. One at a time, each is built on the layer's own
weights, its whole-layer forward captured in CUDA graphs (one per bucket) where it can be and
timed replayed, uncaptured where it cannot (kernels/timing.py: CUDA events, warm-up, L2 flushed,
medians), its output checked against the reference on a few rows, then freed. A backend captured
at small buckets only (the batched formats) is left out, as the tuned tables leave it out: its
times would mix the two modes.

Budget: measuring stops once `budget_s` has passed (checked before each point, so one point may
overrun it). The rule is then made among the backends timed at every bucket, and used for this
start only; where none was, auto falls back to its fixed order. The log says which.

Cache: `<cache_dir>/calibration/<gpu>/<layer>.json`, the rule table with its `key`: the GPU's
name, the layer's configuration, the buckets, the candidates and the code version (moe_serve's
version and a hash of kernels/' source and tuned tables). A file whose key differs is stale: it
is measured again and overwritten. Delete the folder to forget every calibration.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import torch

from .. import __version__
from .accuracy import relative_error, tolerance
from .config import MoEConfig
from .layer import LayerWeights, build_layer
from .layer_graphs import LayerGraphs, can_capture, token_buckets
from .registry import experts_backends
from .rules import COMPOSED, make_rule, plan_text
from .selection import AUTO_ORDER, RuleTable, rule_for, rule_key
from .tensors import ForwardInputs
from .timing import Timer, TimingPlan

log = logging.getLogger(__name__)

CALIBRATION_DIR = "calibration"  # under the service's cache directory
DEFAULT_BUDGET_S = 60.0
# Per point: about 50 ms of timed replays (at least 5), after 2 warm-up calls. A DeepSeek-V3
# layer's 4 candidates at the 16 buckets of 1024 tokens then take seconds of timing; compiling
# and capturing take the rest of the budget.
TIMING = TimingPlan(warmup=2, min_iters=5, max_iters=100, budget_s=0.05)
CHECK_ROWS = 4  # rows checked against the reference (it dequantises each expert they hit)
LEFT_OUT = frozenset({"reference", "reference-batched"}) | COMPOSED
COMMAND = "moe-serve serve --calibrate (kernels/calibrate.py)"  # the rules' provenance


class Mode(StrEnum):
    OFF = "off"  # the tuned tables, else auto's fixed order
    ONCE = "once"  # measure where no tuned rule fits and no cached rule holds
    ALWAYS = "always"  # measure every layer at each start


@dataclass(frozen=True)
class Calibration:
    mode: Mode = Mode.ONCE
    budget_s: float = DEFAULT_BUDGET_S  # per layer
    cache_dir: Path | None = None  # None: nothing is read or written
    timing: TimingPlan = TIMING


NOT_CALIBRATED = Calibration(Mode.OFF)


@dataclass(frozen=True)
class CacheKey:
    """What a cached rule was measured for; a rule holds only where all of it is the same."""

    device: str  # torch.cuda.get_device_name()
    layer: str  # repr of the layer's MoEConfig
    buckets: tuple[int, ...]
    candidates: tuple[str, ...]
    version: str  # code_version()

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict) -> CacheKey:
        return cls(
            body["device"],
            body["layer"],
            tuple(body["buckets"]),
            tuple(body["candidates"]),
            body["version"],
        )


@functools.cache
def code_version() -> str:
    """moe_serve's version and a hash of kernels/' source and tuned tables: what a backend's
    speed depends on in this package."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json") and p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:12]}"


def cache_path(cache_dir: Path, device: str, cfg: MoEConfig) -> Path:
    """<cache_dir>/calibration/<gpu>/E<e>_H<h>_I<i>_<scheme>_<dtype>_<hash of the config>.json"""
    gpu = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")
    dtype = str(cfg.dtype).removeprefix("torch.")
    digest = hashlib.sha256(repr(cfg).encode()).hexdigest()[:8]
    layer = (
        f"E{cfg.num_experts}_H{cfg.hidden_size}_I{cfg.intermediate_size}_"
        f"{cfg.quant.scheme}_{dtype}_{digest}"
    )
    return Path(cache_dir) / CALIBRATION_DIR / gpu / f"{layer}.json"


def read_cached(path: Path, key: CacheKey) -> tuple[RuleTable | None, str]:
    """The cached table at `path` if it was measured for `key`, else None and why not."""
    try:
        body = json.loads(path.read_text())
        stored = CacheKey.from_json(body["key"])
        table = RuleTable.from_body(body, f"the calibration cached in {path}")
    except FileNotFoundError:
        return None, f"no calibration cached at {path}"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"the calibration cached at {path} cannot be read ({err})"
    changed = [name for name, value in asdict(stored).items() if getattr(key, name) != value]
    if changed:
        return None, f"the calibration cached at {path} was measured for another {changed[0]}"
    return table, ""


def write_cached(path: Path, key: CacheKey, table: dict) -> None:
    """The table and its key at `path`, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key.to_json(), **table}, indent=1) + "\n")
    os.replace(tmp, path)


def candidates(cfg: MoEConfig, device: torch.device) -> tuple[str, ...]:
    """The backends calibration times for this layer, auto's fixed order first."""
    backends = experts_backends()
    ok = [n for n, cls in backends.items() if n not in LEFT_OUT and cls.supports(cfg, device)]
    ranked = [n for n in AUTO_ORDER if n in ok]
    return (*ranked, *(n for n in ok if n not in ranked))


class Candidate(Protocol):
    """One backend built on the layer, timed as the service runs it."""

    captured: bool  # replayed from CUDA graphs (else run uncaptured)

    def time_us(self, tokens: int) -> float:
        """Median microseconds of one forward of `tokens` rows."""

    def error(self) -> float:
        """Relative error of its output against the reference's, on the checked rows."""

    def close(self) -> None:
        """Free its device memory."""


OpenCandidate = Callable[[str], Candidate]  # backend name -> built; raises where it cannot be


class NotRanked(Exception):
    """A backend that builds but is not timed, with why (its message)."""


@dataclass(frozen=True)
class Measured:
    served_us: dict[str, dict[str, float]]  # tokens -> backend -> median us (complete ones)
    captured: frozenset[str]
    not_ranked: dict[str, str]  # backend -> why it has no complete, correct times
    stopped: str = ""  # why measuring stopped before the end ("" when it did not)
    seconds: float = 0.0


def _time_one(
    candidate: Candidate,
    buckets: Sequence[int],
    limit: float,
    out_of_time: Callable[[], str],
    on_point: Callable[[], None],
) -> tuple[dict[str, float], str]:
    """One candidate's median us per bucket, and why it is not ranked ("" if it is)."""
    times: dict[str, float] = {}
    for m in buckets:
        if stopped := out_of_time():
            return times, f"timed at {len(times)} of {len(buckets)} buckets: {stopped}"
        try:
            times[str(m)] = candidate.time_us(m)
        except Exception as err:  # a failing backend is a result, not the end of calibration
            return times, f"failed at M={m}: {type(err).__name__}: {err}"
        on_point()
    try:
        error = candidate.error()
    except Exception as err:
        return times, f"failed on the checked rows: {type(err).__name__}: {err}"
    if not error <= limit:  # NaN too
        return times, f"wrong: relative error {error:.3g} on the checked rows (limit {limit:g})"
    return times, ""


def measure(
    names: Sequence[str],
    buckets: Sequence[int],
    open_candidate: OpenCandidate,
    limit: float,
    budget_s: float,
    progress: Callable[[int, int], None] = lambda _done, _total: None,
    clock: Callable[[], float] = time.monotonic,
) -> Measured:
    """Time each of `names` at every bucket, one backend at a time, until `budget_s` is spent.

    `limit`: the relative error a backend may have on the checked rows. `progress(done, total)`
    as points are timed (or passed over), of every (backend, bucket) point."""
    started = clock()
    total, done = len(names) * len(buckets), 0
    served: dict[str, dict[str, float]] = {str(m): {} for m in buckets}
    captured: set[str] = set()
    not_ranked: dict[str, str] = {}
    spent = f"the calibration budget of {budget_s:g} s was spent"

    def out_of_time() -> str:
        return spent if clock() - started > budget_s else ""

    def on_point() -> None:
        nonlocal done
        done += 1
        progress(done, total)

    for index, name in enumerate(names):
        began = clock()
        if out_of_time():
            times, why = {}, f"not measured: {spent}"
        else:
            try:
                candidate = open_candidate(name)
            except NotRanked as err:
                times, why = {}, str(err)
            except Exception as err:  # a backend that cannot be built is a result: not ranked
                times, why = {}, f"cannot be built: {type(err).__name__}: {err}"
            else:
                try:
                    times, why = _time_one(candidate, buckets, limit, out_of_time, on_point)
                finally:
                    candidate.close()
        if done < (index + 1) * len(buckets):  # the points passed over
            done = (index + 1) * len(buckets)
            progress(done, total)
        if why:
            not_ranked[name] = why
            log.warning("calibration: %s not ranked: %s", name, why)
            continue
        for m, us in times.items():
            served[m][name] = us
        if candidate.captured:
            captured.add(name)
        how = "replayed from CUDA graphs" if candidate.captured else "uncaptured"
        log.info("calibration: %s timed at %d buckets (%s) in %.1f s", name, len(buckets), how,
                 clock() - began)  # fmt: skip
    stopped = spent if any(why.endswith(spent) for why in not_ranked.values()) else ""
    return Measured(served, frozenset(captured), not_ranked, stopped, clock() - started)


@dataclass(frozen=True)
class _Inputs:
    """Rows every candidate runs: row r is the same at every token count."""

    hidden: torch.Tensor  # [max bucket, H] in the layer's dtype
    logits: torch.Tensor | None  # [max bucket, E] float32; None: the layer's router computes them
    expected: torch.Tensor  # [CHECK_ROWS, H]: the reference's output for the first rows
    check_tokens: int  # the bucket whose output is checked (its first CHECK_ROWS rows)

    def at(self, m: int) -> ForwardInputs:
        return ForwardInputs(self.hidden[:m], None if self.logits is None else self.logits[:m])


def _inputs(
    cfg: MoEConfig, weights: LayerWeights, device: torch.device, buckets: Sequence[int]
) -> _Inputs:
    generator = torch.Generator(device).manual_seed(0)
    top, rows = buckets[-1], min(CHECK_ROWS, buckets[-1])
    hidden = torch.randn(top, cfg.hidden_size, generator=generator, device=device).to(cfg.dtype)
    logits = None
    if weights.router.weight is None:  # clients send logits: random ones (a uniform load)
        logits = torch.randn(top, cfg.num_experts, generator=generator, device=device)
    reference, _ = build_layer(cfg, weights, device, "reference")
    checked = ForwardInputs(hidden[:rows], None if logits is None else logits[:rows])
    expected = reference.forward(checked).output
    check_tokens = next(m for m in buckets if m >= rows)
    return _Inputs(hidden, logits, expected, check_tokens)


def _free_device_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


class _Served:
    """A backend built on the layer's weights, run as the service runs it: from one CUDA graph
    per bucket where it can be captured (the graphs copy each batch in, as the service's do),
    else uncaptured."""

    def __init__(
        self,
        name: str,
        cfg: MoEConfig,
        weights: LayerWeights,
        inputs: _Inputs,
        captures: bool,
        timer: Timer,
    ) -> None:
        device, top = timer.device, inputs.hidden.shape[0]
        self.layer, _ = build_layer(cfg, weights, device, name, chunk_tokens=top)
        self.inputs, self.timer, self.graphs = inputs, timer, None
        whole = can_capture(self.layer, device, top)
        if captures and whole:
            self.graphs = LayerGraphs(self.layer, device, top, inputs.logits is not None)
        elif captures and can_capture(self.layer, device, 1):
            self.close()
            raise NotRanked(f"{whole.reason}: its times would mix captured and uncaptured runs")
        self.captured = self.graphs is not None

    def _forward(self, m: int) -> torch.Tensor:
        if self.graphs is not None:  # the first call of a bucket captures its graph
            return self.graphs.forward(self.inputs.at(m)).output.output
        return self.layer.forward(self.inputs.at(m)).output

    def time_us(self, tokens: int) -> float:
        if self.graphs is None:
            return self.timer.measure(lambda: self._forward(tokens)).median_us
        self._forward(tokens)  # its rows copied into the graphs' inputs, once
        return self.timer.measure(lambda: self.graphs.replay(tokens)).median_us

    def error(self) -> float:
        expected = self.inputs.expected
        out = self._forward(self.inputs.check_tokens)[: expected.shape[0]]
        return relative_error(out, expected) if torch.isfinite(out).all() else float("inf")

    def close(self) -> None:
        self.graphs = self.layer = None
        _free_device_memory()


def calibrate(
    cfg: MoEConfig,
    weights: LayerWeights,
    device: torch.device,
    chunk_tokens: int,
    captures: bool = True,
    budget_s: float = DEFAULT_BUDGET_S,
    timing: TimingPlan = TIMING,
    progress: Callable[[int, int], None] = lambda _done, _total: None,
) -> tuple[dict, Measured]:
    """Time the layer's candidates at its graph buckets (of up to `chunk_tokens`; `captures`:
    from CUDA graphs where they can be) on the CUDA `device`: the rule table made from the times
    (one rule, the tuned tables' form) and what was measured."""
    names = candidates(cfg, device)
    buckets = token_buckets(chunk_tokens)
    log.info("calibrating: %s at M=%s, for at most %g s", ", ".join(names),
             ",".join(map(str, buckets)), budget_s)  # fmt: skip
    with torch.inference_mode():
        inputs = _inputs(cfg, weights, device, buckets)
        timer = Timer(device, timing)

        open_candidate = functools.partial(
            _Served, cfg=cfg, weights=weights, inputs=inputs, captures=captures, timer=timer
        )
        limit = tolerance(cfg, checked_rows_of_larger_batch=True)
        measured = measure(names, buckets, open_candidate, limit, budget_s, progress)
        del open_candidate, inputs, timer  # the reference output and the L2 flush buffer
        _free_device_memory()
    return rule_table(cfg, _device_name(device), measured, timing), measured


def rule_table(cfg: MoEConfig, device: str, measured: Measured, timing: TimingPlan) -> dict:
    """The rule table of one calibration: one rule, keyed as the tuned tables key it, in their
    form (kernels/rules.py), its backends not ranked and why under `failed`."""
    body = make_rule(measured.served_us, measured.captured) | {"failed": measured.not_ranked}
    return {
        "device": device,
        "commit": code_version(),
        "date": datetime.now(UTC).date().isoformat(),
        "command": COMMAND,
        "method": (
            "medians as served: the whole-layer forward from router logits (or the layer's "
            "router), replayed from CUDA graphs of the layer's buckets for the backends in "
            "`captured`, uncaptured for the others; CUDA events, L2 flushed, "
            f"{timing.warmup} warm-up calls, {timing.min_iters}-{timing.max_iters} iterations, "
            f"about {timing.budget_s * 1e3:g} ms per point (kernels/timing.py), "
            f"measured in {measured.seconds:.1f} s"
        ),
        "rules": {rule_key(cfg): body},
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def calibrated_rules(
    name: str,
    cfg: MoEConfig,
    weights: LayerWeights,
    device: torch.device,
    calibration: Calibration,
    chunk_tokens: int,
    captures: bool = True,
    progress: Callable[[int, int], None] = lambda _done, _total: None,
) -> RuleTable | None:
    """The rules auto follows for layer `name`: calibrated (measured now, or cached), or None
    where the tuned tables and auto's fixed order stand: calibration off, not a GPU, a tuned
    rule fits the layer (mode once), or no backend could be timed at every bucket (logged)."""
    if calibration.mode == Mode.OFF or device.type != "cuda":
        return None
    if calibration.mode == Mode.ONCE and rule_for(cfg, device)[0] is not None:
        return None
    gpu = _device_name(device)
    key = CacheKey(
        gpu, repr(cfg), token_buckets(chunk_tokens), candidates(cfg, device), code_version()
    )
    path = None if calibration.cache_dir is None else cache_path(calibration.cache_dir, gpu, cfg)
    if path is not None and calibration.mode == Mode.ONCE:
        cached, why = read_cached(path, key)
        if cached is not None:
            log.info("layer %s: auto follows %s", name, cached.source)
            return cached
        log.info("layer %s: %s: calibrating", name, why)
    table, measured = calibrate(
        cfg,
        weights,
        device,
        chunk_tokens,
        captures,
        calibration.budget_s,
        calibration.timing,
        progress,
    )
    body = table["rules"][rule_key(cfg)]
    if not body["plan"]:
        log.warning(
            "layer %s: calibration timed no backend at every bucket (%s): auto falls back to "
            "its fixed order",
            name,
            "; ".join(f"{n}: {why}" for n, why in measured.not_ranked.items()),
        )
        return None
    if measured.stopped:
        source = "this start's calibration (cut short: not cached)"
        log.warning(
            "layer %s: %s after %.1f s: the rule ranks %s only, for this start (not cached; "
            "a larger --calibrate-budget-s measures them all)",
            name,
            measured.stopped,
            measured.seconds,
            ", ".join(body["order"]),
        )
    elif path is not None:
        write_cached(path, key, table)
        source = f"the calibration cached in {path}"
    else:
        source = "this start's calibration"
    log.info("layer %s calibrated in %.1f s: auto runs %s", name, measured.seconds,
             plan_text(body["plan"]))  # fmt: skip
    return RuleTable.from_body(table, source)
