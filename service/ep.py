"""Expert parallelism in the service: `moe-serve serve --ep N` runs one process per rank.

    rank 0 (this process): HTTP, batcher, router, shared experts; brings every batch's tokens
    ranks 1..N-1 (spawned): hold their experts; join each forward bringing no tokens

Each forward is one naive-ep collective in its sequence-parallel mode: rank 0 brings the M tokens
of the batch, the others bring 0, and rank 0 gets the sum over ranks back. Rank 0 names the
layer to the others through a queue, so an idle rank waits on the queue rather than inside a
collective that would time out. Each rank reads only its own experts from the layer directory.

A rank that exits, or a collective that fails or times out (COLLECTIVE_TIMEOUT_S), breaks the
group for good: /ready and every request answer 503 naming the cause. The service does not heal
itself; its orchestrator restarts it.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import queue
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.layer import LayerOutput, MoELayer, build_layer
from kernels.placement import Placement
from kernels.prepare_finalize.naive_ep import NaiveEP
from kernels.selection import Selection
from kernels.tensors import ForwardInputs
from kernels.workspace import Workspace
from service.engine import Engine, LayerSource, NonFiniteRows
from service.errors import NotReady
from service.settings import Settings
from weights.load import LoadedLayer, load_layer, read_manifest
from weights.placement_file import read_placement

log = logging.getLogger(__name__)

# How long a rank waits in a collective for the others. Idle ranks wait on their command queue,
# not in a collective, so this bounds only the skew within one forward (first-call compiles).
COLLECTIVE_TIMEOUT_S = 60.0
_POLL_S = 1.0  # how often a waiting rank checks that the processes it waits for are alive


@dataclass(frozen=True)
class RankSpec:
    """What one rank needs to join the group and build its slice of every layer."""

    rank: int
    world_size: int
    port: int  # rank 0's TCP rendezvous on 127.0.0.1
    device: torch.device
    paths: tuple[Path, ...]  # layer directories, in serving order
    placement_file: Path | None  # None: contiguous slices
    backend: str
    chunk_tokens: int  # --max-batch-tokens: rank 0's largest batch, so every rank's largest pass


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU from `base` (all ranks share the CPU when base is the CPU)."""
    if base.type != "cuda":
        return base
    index = (base.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"expert parallelism needs GPU {index} for rank {rank}, but only "
            f"{torch.cuda.device_count()} are visible"
        )
    return torch.device("cuda", index)


def init_group(spec: RankSpec) -> None:
    """Join the group: NCCL on GPUs, gloo on the CPU; every collective times out."""
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    dist.init_process_group(
        "nccl" if spec.device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{spec.port}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def placement_for(spec: RankSpec, num_experts: int) -> Placement:
    if spec.placement_file is None:
        return Placement.contiguous(num_experts, spec.world_size)
    return read_placement(spec.placement_file, num_experts, spec.world_size)


def load_local_layers(spec: RankSpec) -> list[tuple[LoadedLayer, Placement]]:
    """Each layer with only this rank's experts on its device, and the placement it used."""
    loaded = []
    for path in spec.paths:
        placement = placement_for(spec, read_manifest(path).config.num_experts)
        layer = load_layer(path, spec.device, experts=placement.local_experts(spec.rank))
        loaded.append((layer, placement))
    return loaded


def build_ep_layer(
    source: LayerSource, placement: Placement, spec: RankSpec, workspace: Workspace
) -> tuple[MoELayer, Selection]:
    """`source` holds this rank's experts: compose them with naive-ep and the expert_map."""
    layer, choice = build_layer(
        source.config,
        source.weights,
        spec.device,
        spec.backend,
        workspace,
        spec.chunk_tokens,
        expert_map=placement.expert_map(spec.rank).to(spec.device),
        prepare_finalize=NaiveEP(sequence_parallel=True),
    )
    counts = [len(ids) for ids in placement.ranks]
    reason = f"{choice.reason}; experts over {placement.world_size} ranks, per rank {counts}"
    return layer, dataclasses.replace(choice, reason=reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EPEngine(Engine):
    """The engine of rank 0: starts ranks 1..N-1, and has them join every forward."""

    pipelined: ClassVar[bool] = False  # each forward is a collective: run batches one by one

    def __init__(self, settings: Settings, paths: Sequence[Path]) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process is already in a torch.distributed group")
        self.world_size = settings.ep
        super().__init__(
            rank_device(settings.torch_device(), 0), settings.backend, settings.max_batch_tokens
        )
        self._closing = False
        port = _free_port()
        self._spec = RankSpec(
            0,
            self.world_size,
            port,
            self.device,
            tuple(paths),
            settings.ep_placement,
            self.backend,
            self.chunk_tokens,
        )
        ctx = mp.get_context("spawn")
        self._status = ctx.Queue()  # (rank, "" when loaded, else why it failed)
        self._commands = [ctx.Queue() for _ in range(1, self.world_size)]
        self.workers: list[mp.Process] = []  # rank r is workers[r - 1]
        for rank, commands in enumerate(self._commands, start=1):
            spec = dataclasses.replace(self._spec, rank=rank, device=rank_device(self.device, rank))
            self.workers.append(
                ctx.Process(
                    target=_worker_main,
                    args=(spec, commands, self._status),
                    name=f"moe-serve-ep-rank{rank}",
                    daemon=True,  # never outlives this process
                )
            )
        for worker in self.workers:
            worker.start()
        self._placements: dict[str, Placement] = {}
        try:
            init_group(self._spec)
        except Exception:
            self.close()
            raise

    def load(self) -> list[LoadedLayer]:
        """Rank 0's slice of every layer, once every other rank has loaded its own."""
        try:
            loaded = load_local_layers(self._spec)
            self._wait_for_workers()
        except Exception:
            self.close()
            raise
        self._placements = {layer.name: placement for layer, placement in loaded}
        threading.Thread(target=self._watch, name="moe-serve-ep-watch", daemon=True).start()
        return [layer for layer, _ in loaded]

    def build(self, source: LayerSource) -> tuple[MoELayer, Selection]:
        return build_ep_layer(source, self._placements[source.name], self._spec, self.workspace)

    def forward(self, name: str, inputs: ForwardInputs) -> LayerOutput:
        if self.failure is not None:
            raise NotReady(f"expert parallelism is down: {self.failure}")
        self.get(name)  # UnknownLayer before any rank is told to start
        for commands in self._commands:
            commands.put(name)
        try:
            return super().forward(name, inputs)
        except NonFiniteRows:
            raise  # every rank finished the forward: the group is fine
        except Exception as err:
            # the other ranks may be left inside the collective: the group cannot be trusted
            self._fail(f"forward of layer {name!r} failed: {type(err).__name__}: {err}")
            raise NotReady(f"expert parallelism is down: {self.failure}") from err

    def close(self) -> None:
        """Tell the other ranks to exit and wait for them; a broken group's ranks are killed."""
        self._closing = True
        for commands in self._commands:
            commands.put(None)
        for worker in self.workers:
            worker.join(COLLECTIVE_TIMEOUT_S if self.failure is None else 0)
            if worker.is_alive():
                worker.kill()
        for q in (*self._commands, self._status):
            q.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _wait_for_workers(self) -> None:
        pending = set(range(1, self.world_size))
        while pending:
            try:
                rank, problem = self._status.get(timeout=_POLL_S)
            except queue.Empty:
                for rank in pending:
                    worker = self.workers[rank - 1]
                    if not worker.is_alive():
                        raise RuntimeError(
                            f"expert-parallel rank {rank} exited with code {worker.exitcode} "
                            "while loading its experts"
                        ) from None
                continue
            if problem:
                raise RuntimeError(f"expert-parallel rank {rank} failed to load: {problem}")
            pending.discard(rank)

    def _watch(self) -> None:
        """Mark the group broken as soon as any other rank exits."""
        sentinels = {w.sentinel: rank for rank, w in enumerate(self.workers, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if not self._closing:
            rank = sentinels[ready[0]]
            self._fail(f"rank {rank} exited with code {self.workers[rank - 1].exitcode}")

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("expert parallelism is down: %s", reason)
            self.on_failure(f"expert parallelism is down: {reason}")


def _next_command(commands: mp.Queue) -> str | None:
    """The next layer to run, or None to exit (asked to, or rank 0 is gone)."""
    while True:
        try:
            return commands.get(timeout=_POLL_S)
        except queue.Empty:
            if not mp.parent_process().is_alive():
                return None


def _worker_main(spec: RankSpec, commands: mp.Queue, status: mp.Queue) -> None:
    """Ranks 1..N-1: load this rank's experts, then join every forward rank 0 names."""
    logging.basicConfig(level=logging.INFO, format=f"rank {spec.rank} %(levelname)s %(message)s")
    try:
        init_group(spec)
        workspace = Workspace(spec.device)
        layers = {
            layer.name: build_ep_layer(layer, placement, spec, workspace)[0]
            for layer, placement in load_local_layers(spec)
        }
    except Exception as err:
        status.put((spec.rank, f"{type(err).__name__}: {err}"))
        return
    status.put((spec.rank, ""))
    while (name := _next_command(commands)) is not None:
        cfg = layers[name].cfg
        no_tokens = ForwardInputs(
            torch.empty(0, cfg.hidden_size, device=spec.device),
            torch.empty(0, cfg.num_experts, device=spec.device),
        )
        with torch.inference_mode():
            layers[name].forward(no_tokens)
    dist.destroy_process_group()
