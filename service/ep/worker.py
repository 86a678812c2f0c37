"""Expert-parallel ranks 1..N-1: load this rank's experts, then run every command rank 0 posts
(service/ep/group.py) until it says exit or is gone. Spawned by rank 0 (`worker_main`) or
started on another host (`moe-serve ep-rank`, `run_rank`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ...kernels.graph_capture import capturing
from ...kernels.modular import ModularKernel
from ...kernels.placement import Placement
from ...kernels.tensors import Routing
from ...kernels.workspace import Workspace
from ...weights.load import load_layer
from ..engine.interface import LayerSource
from ..engine.profiling import kernel_profiler, write_profile
from . import group
from .group import Commands, Generation, Rendezvous, leave
from .layers import (
    COLLECTIVE_TIMEOUT_S,
    JOIN_TIMEOUT_S,
    LayerPlan,
    RankSpec,
    build_ep_kernel,
    regroup_kernel,
)

log = logging.getLogger(__name__)


@dataclass
class _RankLayer:
    kernel: ModularKernel
    placement: Placement  # over the global ranks
    hidden: torch.Tensor  # [chunk_tokens, H] placeholders the broadcast overwrites
    routing: Routing
    staged: dict[int, tuple[ModularKernel, Placement] | None] = field(default_factory=dict)
    # bucket -> one graph per copy of rank 0's (each of its pipeline slots replays its own)
    graphs: dict[int, list[torch.cuda.CUDAGraph]] = field(default_factory=dict)

    def forward(self, tokens: int, workspace: Workspace | None = None) -> None:
        rows = slice(0, tokens)
        r = self.routing
        routing = Routing(r.topk_ids[rows], r.topk_weights[rows])
        self.kernel.forward(self.hidden[rows], routing, workspace=workspace)

    def capture(self, buckets: Sequence[int], copies: int, device: torch.device) -> None:
        """As kernels.layer_graphs captures rank 0's: largest bucket first, each of its copies
        after an eager run on a side stream (a collective with rank 0's), experts' buffers in
        the graph pool. The copies share this rank's buffers: its forwards run one by one."""
        pool = torch.cuda.graph_pool_handle()
        self.graphs.clear()
        with torch.cuda.device(device):
            for bucket in sorted(buckets, reverse=True):
                self.graphs[bucket] = []
                for _ in range(copies):
                    side = torch.cuda.Stream(device)
                    side.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(side):
                        self.forward(bucket, Workspace(device))
                    torch.cuda.current_stream(device).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with capturing(graph, pool):
                        self.forward(bucket, Workspace(device))
                    self.graphs[bucket].append(graph)


class _Rank:
    """One rank other than 0: its layers, its group, and the commands rank 0 posts."""

    def __init__(self, rank: int, store: dist.Store, device: torch.device) -> None:
        self.rank, self.store, self.device = rank, store, device
        self.store.wait(["spec"])
        self.spec = RankSpec.from_json(self.store.get("spec"))
        if self.spec.device_type != device.type:  # NCCL and gloo ranks cannot meet
            raise ValueError(f"rank 0 runs on {self.spec.device_type}, rank {rank} on {device}")
        self.members = list(range(self.spec.world_size))
        self.gen: Generation | None = None
        self.retired: list[Generation] = []  # kept: a broken group is never destroyed
        self.workspace = Workspace(device)
        self.layers: dict[str, _RankLayer] = {}
        self.profiler: torch.profiler.profile | None = None  # between profile_start and _stop

    def load(self) -> None:
        """Load and build every layer, tell rank 0 (which waits for every rank), then join the
        first generation's group."""
        for plan in self.spec.layers:
            source = self._load(plan, plan.placement)
            kernel = self._kernel(source, plan.placement, self.workspace)
            cfg = source.config
            chunk = self.spec.chunk_tokens
            self.layers[plan.name] = _RankLayer(
                kernel,
                plan.placement,
                torch.zeros(chunk, cfg.hidden_size, dtype=cfg.dtype, device=self.device),
                Routing(
                    torch.zeros(chunk, cfg.routing.top_k, dtype=torch.int32, device=self.device),
                    torch.zeros(chunk, cfg.routing.top_k, device=self.device),
                ),
            )
        self.store.set(f"status/{self.rank}", "")
        self.gen = group.make_group(
            self.store, 0, self.members, self.rank, self.device, COLLECTIVE_TIMEOUT_S
        )
        for plan in self.spec.layers:
            layer = self.layers[plan.name]
            regroup_kernel(layer.kernel, plan.placement, self.rank, self.gen)

    def _load(self, plan: LayerPlan, placement: Placement) -> LayerSource:
        return load_layer(Path(plan.path), self.device, experts=placement.local_experts(self.rank))

    def _kernel(self, source: LayerSource, placement: Placement, ws: Workspace) -> ModularKernel:
        index = self.members.index(self.rank)
        survivors = placement.surviving(self.members)
        return build_ep_kernel(
            source, survivors, index, lambda: self.gen, self.spec, self.device, ws
        )[0].kernel

    def serve(self, commands: Commands) -> None:
        """Run rank 0's commands until it says exit or is gone."""
        while (command := commands.next()) is not None and command["op"] != "exit":
            try:
                with torch.inference_mode():
                    getattr(self, f"_{command['op']}")(command)
            except Exception:  # a broken group: rank 0 regroups or fails; wait for its word
                log.exception("rank %d: command %s failed", self.rank, command["op"])

    def _forward(self, command: dict) -> None:
        layer = self.layers[command["layer"]]
        bucket = command["bucket"]
        if bucket is None:  # rank 0 runs its eager forward: as many rows
            layer.forward(command["tokens"])
        else:  # rank 0 replays this copy of the bucket's graph
            layer.graphs[bucket][command["copy"]].replay()

    def _profile_start(self, _command: dict) -> None:
        self.profiler = kernel_profiler(self.device)
        self.profiler.start()

    def _profile_stop(self, command: dict) -> None:
        self.profiler.stop()
        path = Path(command["path"].format(rank=self.rank))
        write_profile(self.profiler, self.device, f"{command['header']}, rank {self.rank}", path)
        self.profiler = None

    def _capture(self, command: dict) -> None:
        self.layers[command["layer"]].capture(command["buckets"], command["copies"], self.device)

    def _regroup(self, command: dict) -> None:
        self.members = command["members"]
        if self.rank not in self.members:
            raise SystemExit(f"rank {self.rank} was dropped from the group")
        self.gen.abort()
        self.retired.append(self.gen)
        self.gen = group.make_group(
            self.store,
            command["generation"],
            self.members,
            self.rank,
            self.device,
            COLLECTIVE_TIMEOUT_S,
        )
        index = self.members.index(self.rank)
        for layer in self.layers.values():
            regroup_kernel(layer.kernel, layer.placement.surviving(self.members), index, self.gen)
            layer.staged.clear()
            layer.graphs.clear()  # they hold the old group's communicator

    def _stage(self, command: dict) -> None:
        layer = self.layers[command["layer"]]
        placement = Placement(tuple(map(tuple, command["ranks"])), layer.placement.num_experts)
        plan = next(p for p in self.spec.layers if p.name == command["layer"])
        layer.staged[command["id"]] = None
        threading.Thread(
            target=self._stage_in_background,
            args=(layer, plan, placement, command["id"]),
            name="moe-serve-ep-stage",
            daemon=True,
        ).start()

    def _stage_in_background(
        self, layer: _RankLayer, plan: LayerPlan, placement: Placement, seq: int
    ) -> None:
        try:
            with torch.inference_mode():
                kernel = self._kernel(
                    self._load(plan, placement), placement, Workspace(self.device)
                )
            layer.staged[seq] = (kernel, placement)
            problem = ""
        except Exception as err:
            log.exception("rank %d: staging layer %s failed", self.rank, plan.name)
            problem = f"{type(err).__name__}: {err}"
        self.store.set(f"staged/{seq}/{self.rank}", problem)

    def _switch(self, command: dict) -> None:
        layer = self.layers[command["layer"]]
        layer.kernel, layer.placement = layer.staged.pop(command["id"])
        layer.graphs.clear()  # rank 0 has them captured anew (a capture command follows)

    def _drop(self, command: dict) -> None:
        self.layers[command["layer"]].staged.pop(command["id"], None)


def _heartbeat(
    rank: int, rv: Rendezvous, stop: threading.Event, current: Callable[[], Generation | None]
) -> None:
    """Tell rank 0 this rank lives; abort the current group when rank 0 gives it up."""
    store = group.connect(rv, rank, JOIN_TIMEOUT_S)
    while not stop.wait(group.HEARTBEAT_S):
        try:
            store.add(f"beat/{rank}", 1)
            gen = current()
            if (
                gen is not None
                and not gen.aborted.is_set()
                and store.check([f"abort/{gen.number}"])
            ):
                gen.abort()
        except (RuntimeError, dist.DistError):
            return  # rank 0 is gone; the main loop sees it too


def run_rank(rank: int, rv: Rendezvous, device: torch.device) -> None:
    """Ranks 1..N-1: load this rank's experts, then join every forward rank 0 announces."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = group.connect(rv, rank, JOIN_TIMEOUT_S)
    stop = threading.Event()
    state: _Rank | None = None
    threading.Thread(
        target=_heartbeat,
        args=(rank, rv, stop, lambda: None if state is None else state.gen),
        name="moe-serve-ep-heartbeat",
        daemon=True,
    ).start()
    try:
        state = _Rank(rank, store, device)
        state.load()
    except Exception as err:  # rank 0 waits for this rank's word
        store.set(f"status/{rank}", f"{type(err).__name__}: {err}")
        raise
    state.serve(Commands(store))
    stop.set()
    # No abort of the healthy group on the way out: leave() ends the process without its
    # destructors, and NCCL's abort of communicators used in CUDA graphs hung for its whole
    # 60 s timeout there (2 x H200), holding up rank 0's close.


def worker_main(rank: int, rv: Rendezvous, device: str) -> None:
    """A rank spawned by rank 0 on this host."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(levelname)s %(message)s")
    try:
        run_rank(rank, rv, torch.device(device))
    except Exception:
        log.exception("rank %d failed", rank)
        leave(1)
    leave(0)
