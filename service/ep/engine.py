"""Expert parallelism in the service: `moe-serve serve --ep N` runs one process per rank.

    rank 0 (this process): HTTP, batcher, router, shared experts; brings every batch's tokens
    ranks 1..N-1: hold their experts; join each forward rank 0 announces (service/ep/worker.py).
    Spawned here, or, for ranks past --ep-local-ranks, started on other hosts (`moe-serve
    ep-rank`, service/ep/rank.py)

Each forward is one naive-ep collective in its sender mode: rank 0 posts the layer and the token
count M (service/ep/group.py), broadcasts the packed rows and gets the sum over ranks back
(reduce). Every rank knows M from the command, so the forward runs on fixed shapes: no host sync
on any rank. Each rank reads only its own experts from the layer directory. On GPUs rank 0 runs
batches through the same device pipeline as one GPU (service/engine/pipeline.py: copies overlapped
with the forward before, up to three batches in flight, graph copies per slot), posting each forward
as it is enqueued; the other ranks replay the same bucket and copy, in the same order.

Replicas: a placement may hold an expert on several ranks (--ep-placement, --ep-redundant); its
pairs split between the copies by token index. Rank 0 computes each step's load per rank from the
batch's routing once it is back on the host (moe_serve_ep_balancedness).

A rank that dies (its process exits, or it stops its heartbeat) breaks the group. If each of its
experts has a copy on a live rank, the survivors form a new group and keep serving with the
replica maps rewritten (degraded: /ready says why, moe_serve_ep_live_ranks drops); the batches in
flight are run again on the new group. Otherwise /ready and every request answer 503.

Rebalance (`rebalance`): every rank loads its experts of the new placement in the background
while the old one serves, then all switch between two forwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing.connection
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ...kernels.input_checks import all_finite_on_device, check_shapes
from ...kernels.layer import LayerOutput, MoELayer, expert_tokens
from ...kernels.layer_graphs import LayerGraphs
from ...kernels.placement import Placement, balancedness, rank_tokens
from ...kernels.prepare_finalize.naive_ep import NaiveEP
from ...kernels.selection import Selection
from ...kernels.tensors import ForwardInputs, Routing
from ...kernels.workspace import Workspace
from ...weights.load import load_layer, read_manifest
from ..engine.engine import Engine
from ..engine.interface import BatchResult, LayerSource, NonFiniteRows, Pending, ServedLayer
from ..errors import NotReady
from ..settings import Settings
from . import group
from .group import Commands, Generation, Rendezvous
from .layers import (
    COLLECTIVE_TIMEOUT_S,
    JOIN_TIMEOUT_S,
    LayerPlan,
    RankSpec,
    build_ep_kernel,
    initial_placement,
    rank_device,
    regroup_kernel,
)
from .worker import worker_main

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 10.0  # a rank whose heartbeat stops this long counts as dead
_POLL_S = 0.2


@dataclass
class _Layer:
    """Rank 0's view of one layer's placement (over the global ranks)."""

    plan: LayerPlan
    placement: Placement
    owners: torch.Tensor  # owner_map over the live group (CPU)
    counts: torch.Tensor  # tokens per expert since the last placement switch (CPU float64)
    balancedness: float = 1.0  # of the last step
    rebalance: str = "none"  # none | staging | done | failed: <why>


@dataclass
class _Liveness:
    """Heartbeats of ranks on other hosts: the last counter seen and when it changed."""

    seen: dict[int, tuple[int, float]] = field(default_factory=dict)


class EPEngine(Engine):
    """The engine of rank 0: starts or awaits the other ranks, and has them join every forward."""

    def __init__(
        self, settings: Settings, paths: Sequence[Path], metrics: object | None = None
    ) -> None:
        self.world_size = settings.ep
        self.device = rank_device(settings.torch_device(), 0)  # rank 0's, every layer's
        super().__init__(
            [self.device],
            settings.backend,
            settings.max_batch_tokens,
            cuda_graphs=settings.cuda_graphs,
        )
        self.metrics = metrics  # service.metrics.Metrics: the EP gauges
        for pipeline in self.pipelines.values():
            pipeline.on_forward = self._announce
        self.degraded: str | None = None  # why fewer ranks serve than started; None: all do
        self._closing = False
        self._lock = threading.RLock()  # one forward, regroup or switch at a time
        self.members = list(range(self.world_size))  # live global ranks; group rank = index
        self.gen: Generation | None = None  # the group among them
        self._retired: list[Generation] = []  # kept: a broken group is never destroyed
        self._liveness = _Liveness()
        self._rebalance_seq = 0
        self._staged: dict[str, tuple[int, ServedLayer, Placement]] = {}
        self.rendezvous = Rendezvous.for_rank0(self.world_size)
        self.store = group.connect(self.rendezvous, 0, JOIN_TIMEOUT_S)
        self.commands = Commands(self.store)
        plans = []
        for path in paths:
            manifest = read_manifest(path)
            placement = initial_placement(settings, manifest.config.num_experts)
            plans.append(
                LayerPlan(manifest.name, str(path), placement.ranks, placement.num_experts)
            )
        self.spec = RankSpec(
            self.world_size, self.device.type, self.backend, self.chunk_tokens, tuple(plans)
        )
        self.store.set("spec", self.spec.to_json())
        self._layers: dict[str, _Layer] = {}
        ctx = mp.get_context("spawn")
        local = settings.ep_local_ranks or self.world_size
        self.workers: list[mp.Process] = []  # the ranks spawned here: rank r is workers[r - 1]
        for rank in range(1, local):
            device = rank_device(self.device, rank)
            self.workers.append(
                ctx.Process(
                    target=worker_main,
                    args=(rank, self.rendezvous, str(device)),
                    name=f"moe-serve-ep-rank{rank}",
                    daemon=True,  # never outlives this process
                )
            )
        for worker in self.workers:
            worker.start()

    # ---- start ------------------------------------------------------------------------------

    def load(self) -> list[LayerSource]:
        """Rank 0's slice of every layer, once every other rank has loaded its own."""
        try:
            loaded = [
                load_layer(Path(p.path), self.device, experts=p.placement.local_experts(0))
                for p in self.spec.layers
            ]
            self._wait_for_ranks()
            self.gen = group.make_group(
                self.store, 0, self.members, 0, self.device, COLLECTIVE_TIMEOUT_S
            )
        except Exception:
            self.close()
            raise
        NaiveEP.outside_groups += 1
        for plan in self.spec.layers:
            self._layers[plan.name] = self._layer_state(plan, plan.placement)
        self._set_rank_gauges()
        threading.Thread(target=self._watch, name="moe-serve-ep-watch", daemon=True).start()
        return loaded

    def _layer_state(self, plan: LayerPlan, placement: Placement) -> _Layer:
        owners = placement.surviving(self.members).owner_map()
        return _Layer(
            plan, placement, owners, torch.zeros(placement.num_experts, dtype=torch.float64)
        )

    @property
    def start_may_wait(self) -> bool:
        return True  # for a regroup, or a capture after a rebalance (seconds)

    def warm_up(self, token_counts: Sequence[int], names: Sequence[str] | None = None) -> None:
        """Every rank captures with rank 0, layer by layer, bucket by bucket (the eager run
        before each capture is a collective), then the warm-up forwards run."""
        for name in list(self.layers) if names is None else names:
            graphs = self.layers[name].graphs
            if graphs is not None:
                self._post_capture(name, graphs)
        super().warm_up(token_counts, names)

    def _post_capture(self, name: str, graphs: LayerGraphs) -> None:
        """Every other rank captures as rank 0 is about to: each copy of each bucket, largest
        bucket first, an eager forward (a collective) before each capture."""
        self.commands.post(
            op="capture", layer=name, buckets=list(graphs.buckets), copies=graphs.copies
        )

    def build(self, source: LayerSource) -> tuple[MoELayer, Selection]:
        placement = self._layers[source.name].placement
        return build_ep_kernel(
            source,
            placement,
            0,
            lambda: self.gen,
            self.spec,
            self.device,
            self.workspaces[self.device],
        )

    def _worker(self, rank: int) -> mp.Process | None:
        """The process of `rank` when this one spawned it (None: it runs on another host)."""
        return self.workers[rank - 1] if rank <= len(self.workers) else None

    def _wait_for_ranks(self) -> None:
        pending = set(range(1, self.world_size))
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while pending:
            for rank in sorted(pending):
                if self.store.check([f"status/{rank}"]):
                    problem = self.store.get(f"status/{rank}").decode()
                    if problem:
                        raise RuntimeError(f"expert-parallel rank {rank} failed to load: {problem}")
                    pending.discard(rank)
                elif (worker := self._worker(rank)) is not None and not worker.is_alive():
                    raise RuntimeError(
                        f"expert-parallel rank {rank} exited with code "
                        f"{worker.exitcode} while loading its experts"
                    )
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"expert-parallel ranks {sorted(pending)} did not join "
                    f"{self.rendezvous.host}:{self.rendezvous.port} in {JOIN_TIMEOUT_S:.0f} s"
                )
            time.sleep(_POLL_S if pending else 0)

    # ---- forward ----------------------------------------------------------------------------
    #
    # On GPUs each batch goes through the device pipeline like one GPU's (copies overlapped, up
    # to DEPTH batches in flight, one graph replay each): as a batch's forward is enqueued,
    # rank 0 posts it (`_announce`), under the lock, so every rank runs the forwards in the
    # order of rank 0's compute stream. A forward whose group was aborted meanwhile (a rank
    # died) returns unfinished data: its batch runs again once the survivors have regrouped
    # (`_EPBatch`). On the CPU (gloo) `start` runs each batch through `forward`.

    def start(
        self,
        name: str,
        parts: Sequence[ForwardInputs],
        into: Sequence[torch.Tensor | None] | None = None,
    ) -> Pending:
        if not self.enqueues:
            return super().start(name, parts, into)
        with self._lock:
            gen = self.gen
            pending = super().start(name, parts, into)
        return _EPBatch(self, name, parts, into, gen, pending)

    def _announce(
        self, served: ServedLayer, tokens: int, bucket: int | None, copy: int | None
    ) -> None:
        """The device pipeline enqueues this forward on rank 0 now: the others run it too."""
        self.commands.post(op="forward", layer=served.name, tokens=tokens, bucket=bucket, copy=copy)

    def _rerun(self, batch: _EPBatch) -> BatchResult:
        """A batch whose group was aborted under it: once the survivors have regrouped (or
        here, if nobody has yet), it runs again on theirs; NotReady when none can serve."""
        with self._lock:
            if self.gen is batch.gen and self.failure is None:
                reason = f"a forward of layer {batch.name!r} was aborted: a rank died"
                self._recover(reason, wait_s=HEARTBEAT_TIMEOUT_S)
        log.warning("layer %s: the batch runs again on ranks %s", batch.name, self.members)
        return self.start(batch.name, batch.parts, batch.into).result()

    def _count(self, name: str, ids: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
        """A forward's load: the placement's counts and the balancedness gauge (host)."""
        state = self._layers[name]
        per_rank = rank_tokens(ids, state.owners, len(self.members))
        state.balancedness = float(balancedness(per_rank))
        state.counts += tokens_per_expert
        if self.metrics is not None:
            self.metrics.ep_balancedness.labels(name).set(state.balancedness)

    def forward(self, name: str, inputs: ForwardInputs) -> LayerOutput:
        """One batch, synchronously: the CPU (gloo) path; retried on the survivors' group
        after a rank dies."""
        with self._lock:
            if self.failure is not None:
                raise NotReady(f"expert parallelism is down: {self.failure}")
            self.get(name)  # UnknownLayer before any rank is told to start
            while True:  # each retry follows a recovery, which drops a rank: it ends
                try:
                    return self._forward_once(name, inputs)
                except NonFiniteRows:
                    raise  # every rank finished the forward: the group is fine
                except Exception as err:
                    reason = f"forward of layer {name!r} failed: {type(err).__name__}: {err}"
                    if not self._recover(reason, wait_s=HEARTBEAT_TIMEOUT_S):
                        raise NotReady(f"expert parallelism is down: {self.failure}") from err
                log.warning("layer %s: the batch runs again on ranks %s", name, self.members)

    def _forward_once(self, name: str, inputs: ForwardInputs) -> LayerOutput:
        served, gen = self.get(name), self.gen
        check_shapes(served.config, inputs, has_router=served.has_router)  # before ranks start
        tokens = inputs.hidden_states.shape[0]
        self.commands.post(op="forward", layer=name, tokens=tokens, bucket=None, copy=None)
        with torch.inference_mode():
            on_device = ForwardInputs(
                inputs.hidden_states.to(self.device),
                None if inputs.router_logits is None else inputs.router_logits.to(self.device),
            )
            result = served.layer.forward(on_device)
            finite = bool(all_finite_on_device(result.output))
        if gen.aborted.is_set():  # an aborted collective returns, its data unfinished
            raise RuntimeError("the group was aborted during the forward: a rank died")
        routing = result.routing
        output = LayerOutput(
            result.output.cpu(), Routing(routing.topk_ids.cpu(), routing.topk_weights.cpu())
        )
        ids = output.routing.topk_ids
        self._count(name, ids, expert_tokens(ids, served.config.num_experts))
        if not finite:
            raise NonFiniteRows(name, output)
        return output

    # ---- failures ---------------------------------------------------------------------------

    def _dead_ranks(self) -> dict[int, str]:
        """Members (other than 0) that are gone, with why."""
        dead = {}
        now = time.monotonic()
        for rank in self.members[1:]:
            worker = self._worker(rank)
            if worker is not None:
                if not worker.is_alive():
                    dead[rank] = f"rank {rank} exited with code {worker.exitcode}"
                continue
            beat = self.store.add(f"beat/{rank}", 0)
            last, since = self._liveness.seen.get(rank, (-1, now))
            if beat != last:
                self._liveness.seen[rank] = (beat, now)
            elif now - since > HEARTBEAT_TIMEOUT_S:
                dead[rank] = f"rank {rank} sent no heartbeat for {now - since:.0f} s"
        return dead

    def _recover(self, reason: str, wait_s: float) -> bool:
        """After a failed collective or a lost rank: serve on without the dead ranks if every
        expert keeps a live copy (True), else fail for good (False). Holds the lock."""
        deadline = time.monotonic() + wait_s
        while not (dead := self._dead_ranks()) and time.monotonic() < deadline:
            time.sleep(_POLL_S)  # a collective failed: see which rank it was
        if not dead:
            self._fail(reason)
            return False
        why = "; ".join(dead.values())
        live = [r for r in self.members if r not in dead]
        try:
            for state in self._layers.values():
                state.placement.surviving(live)
        except ValueError as err:
            self._fail(f"{why}; {err} in layer {state.plan.name!r}")
            return False
        try:
            self._regroup(live)
        except Exception as err:
            self._fail(f"{why}; the survivors could not form a new group: {err}")
            return False
        self.degraded = f"{why}; serving on ranks {live} (every expert has a live copy)"
        log.warning("expert parallelism degraded: %s", self.degraded)
        self.on_degraded(self.degraded)
        self._set_rank_gauges()
        return True

    def _abort_generation(self) -> None:
        """Every rank stops waiting on the current group's collectives (they never finish)."""
        self.store.set(f"abort/{self.gen.number}", "1")
        self.gen.abort()

    def _regroup(self, live: list[int]) -> None:
        self._abort_generation()
        self._retired.append(self.gen)
        self.members = live
        for name, staged in list(self._staged.items()):
            self._cancel_staged(name, staged[0], "a rank died while staging")
        number = self.gen.number + 1
        self.commands.post(op="regroup", generation=number, members=live)
        self.gen = group.make_group(self.store, number, live, 0, self.device, COLLECTIVE_TIMEOUT_S)
        for name, state in self._layers.items():
            survivors = state.placement.surviving(live)
            served = self.get(name)
            regroup_kernel(served.layer.kernel, survivors, 0, self.gen)
            state.owners = survivors.owner_map()
            # graphs hold the old group's communicator: degraded ranks run eagerly
            self.layers[name] = dataclasses.replace(served, graphs=None)

    def _watch(self) -> None:
        """Notice a lost rank between forwards too (a forward notices it by failing); prune
        the commands every rank has read."""
        sentinels = {w.sentinel: r for r, w in enumerate(self.workers, start=1)}
        while not self._closing and self.failure is None:
            multiprocessing.connection.wait(list(sentinels), timeout=1.0)
            if self._closing:
                return
            self.commands.prune()
            if self.failure is None and self._dead_ranks():
                self._abort_generation()  # a forward waiting on the dead rank returns now
                with self._lock:
                    if self.failure is None and (dead := self._dead_ranks()):
                        self._recover("; ".join(dead.values()), wait_s=0)
            sentinels = {s: r for s, r in sentinels.items() if r in self.members}

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("expert parallelism is down: %s", reason)
            self.on_failure(f"expert parallelism is down: {reason}")
            self._set_rank_gauges()

    def _set_rank_gauges(self) -> None:
        if self.metrics is not None:
            live = 0 if self.failure is not None else len(self.members)
            self.metrics.ep_live_ranks.set(live)
            self.metrics.ep_degraded.set(int(self.degraded is not None or live == 0))

    # ---- rebalance --------------------------------------------------------------------------

    def placement(self, name: str) -> dict:
        """The layer's placement as GET /v1/layers/{name}/placement shows it."""
        self.get(name)
        state = self._layers[name]
        return {
            "layer": name,
            "ranks": [list(ids) for ids in state.placement.ranks],
            "live_ranks": list(self.members),
            "balancedness": state.balancedness,
            "expert_tokens": [int(c) for c in state.counts.tolist()],
            "rebalance": state.rebalance,
        }

    def _plan(
        self, name: str, ranks: Sequence[Sequence[int]] | None, redundant: int | None
    ) -> Placement:
        """The placement a rebalance switches to: `ranks`, or (None) one balanced on the tokens
        seen since the last switch with `redundant` copies (None: as many as now). ValueError
        when it does not fit, RuntimeError when no rebalance can start now."""
        state = self._layers[name]
        if self.failure is not None or self.degraded is not None:
            raise RuntimeError(f"cannot rebalance: {self.degraded or self.failure}")
        if state.rebalance == "staging":
            raise RuntimeError(f"layer {name!r} is already being rebalanced")
        current = state.placement
        if ranks is not None:
            if len(ranks) != self.world_size:
                raise ValueError(f"lists {len(ranks)} ranks, the group has {self.world_size}")
            return Placement(tuple(map(tuple, ranks)), current.num_experts)
        if redundant is None:
            redundant = sum(map(len, current.ranks)) - current.num_experts
        return Placement.balanced(state.counts.tolist(), self.world_size, redundant)

    def rebalance(
        self, name: str, ranks: Sequence[Sequence[int]] | None, redundant: int | None = None
    ) -> Placement:
        """Switch layer `name` to the placement `ranks` (None: balanced on the recent counts,
        with `redundant` copies of the hottest experts, None: as many as now):
        every rank loads its new experts in the background; the old placement serves until
        all have, then all switch between two forwards. Returns the placement once staging
        has started; `placement(name)["rebalance"]` follows it."""
        self.get(name)
        with self._lock:
            placement = self._plan(name, ranks, redundant)
            self._rebalance_seq += 1
            seq = self._rebalance_seq
            self._layers[name].rebalance = "staging"
            self.commands.post(
                op="stage", layer=name, id=seq, ranks=[list(ids) for ids in placement.ranks]
            )
        threading.Thread(
            target=self._stage, args=(name, placement, seq), name="moe-serve-ep-stage", daemon=True
        ).start()
        return placement

    def _stage(self, name: str, placement: Placement, seq: int) -> None:
        state = self._layers[name]
        try:
            source = load_layer(
                Path(state.plan.path), self.device, experts=placement.local_experts(0)
            )
            layer, choice = build_ep_kernel(
                source,
                placement,
                0,
                lambda: self.gen,
                self.spec,
                self.device,
                Workspace(self.device),
            )
            served = dataclasses.replace(
                self.get(name),
                layer=layer,
                selection=choice,
                device_bytes=source.weights.nbytes(),
                graphs=None,
            )
            with self._lock:
                self._staged[name] = (seq, served, placement)
            self._await_staged(seq)
        except Exception as err:
            log.exception("rebalancing layer %s failed", name)
            with self._lock:
                self._cancel_staged(name, seq, f"{type(err).__name__}: {err}")
            return
        with self._lock:
            if self._staged.get(name, (None,))[0] != seq:
                return  # cancelled meanwhile (a rank died)
            del self._staged[name]
            self.commands.post(op="switch", layer=name, id=seq)
            self.layers[name] = served
            self._capture(name)
            self._layers[name] = dataclasses.replace(
                self._layer_state(state.plan, placement), rebalance="done"
            )
        log.info("layer %s: placement switched to %s", name, [list(r) for r in placement.ranks])

    def _capture(self, name: str) -> None:
        """Capture a switched layer's graphs on every rank (between two forwards: holds the
        lock); a layer that cannot be captured runs eagerly."""
        served = self.get(name)
        graphs = self.layer_graphs(name, served.layer, self.device) if self.captures else None
        if graphs is None:
            return
        self._post_capture(name, graphs)
        with torch.inference_mode():
            graphs.capture()
        self.layers[name] = dataclasses.replace(served, graphs=graphs)

    def _await_staged(self, seq: int) -> None:
        for rank in self.members[1:]:
            key = f"staged/{seq}/{rank}"
            while not self.store.check([key]):
                if self._closing or rank not in self.members or self._dead_ranks():
                    raise RuntimeError(f"rank {rank} did not stage its experts")
                time.sleep(_POLL_S)
            problem = self.store.get(key).decode()
            if problem:
                raise RuntimeError(f"rank {rank} could not stage its experts: {problem}")

    def _cancel_staged(self, name: str, seq: int, why: str) -> None:
        self._staged.pop(name, None)
        self._layers[name].rebalance = f"failed: {why}"
        if self.failure is None:
            self.commands.post(op="drop", layer=name, id=seq)

    # ---- profiles (bench.ep_service --profile) ------------------------------------------------

    def start_rank_profiles(self) -> None:
        """The other ranks profile their device's kernels from the next forward on."""
        self.commands.post(op="profile_start")

    def stop_rank_profiles(self, path: Path, header: str) -> None:
        """The other ranks stop profiling and each writes its kernel table, under `header`, to
        `path` with {rank} replaced by its rank (on its own host), and its Chrome trace beside
        it (service.engine.profiling.write_profile), before its next command."""
        self.commands.post(op="profile_stop", path=str(path), header=header)

    # ---- stop -------------------------------------------------------------------------------

    def close(self) -> None:
        """Tell the other ranks to exit and wait for the spawned ones; stragglers are killed."""
        self._closing = True
        with contextlib.suppress(RuntimeError, dist.DistError):
            self.commands.post(op="exit")
        for worker in self.workers:
            worker.join(COLLECTIVE_TIMEOUT_S if self.failure is None else 0)
            if worker.is_alive():
                worker.kill()
        if self.gen is not None:  # the retired ones were aborted when they retired
            if self.failure is not None:
                self.gen.abort()  # a rank may still wait in one of its collectives
            # else no abort: every rank has left it, and NCCL's abort of a healthy group whose
            # collectives were captured in CUDA graphs outlasted any wait (2 x H200: still
            # aborting 5 s on); its communicators go with the process
            NaiveEP.outside_groups -= 1
            self.gen = None


@dataclass(frozen=True)
class _EPBatch:
    """A batch in rank 0's device pipeline and the group it was launched on."""

    engine: EPEngine
    name: str
    parts: Sequence[ForwardInputs]  # kept until the result is in: a rerun needs them
    into: Sequence[torch.Tensor | None] | None
    gen: Generation
    pending: Pending

    def done(self) -> bool:
        """Whether rank 0's forward is done (`result` may still run it again, on an aborted
        group: the batcher never waits for an expert-parallel batch on its event loop)."""
        return self.pending.done()

    def result(self) -> BatchResult:
        try:
            result = self.pending.result()
        except Exception:
            if not self.gen.aborted.is_set():
                raise
            return self.engine._rerun(self)  # whatever went wrong, the group broke under it
        if self.gen.aborted.is_set():  # NCCL: an aborted collective returns, its data unfinished
            return self.engine._rerun(self)
        ids = torch.cat([out.routing.topk_ids for out in result.outputs])
        self.engine._count(self.name, ids, result.expert_tokens)
        return result
