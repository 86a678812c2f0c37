"""Whole-layer CUDA graphs: router GEMM, routing, experts and shared experts captured once per
token bucket, so a forward costs one graph launch however many kernels the backend launches.

    forward(hidden [m, H]) -> copy into the static input, replay the bucket's graph -> views of
                              its static outputs [:m]

A graph also zeroes the padded rows m..bucket of its input (they may hold an earlier batch),
counts the tokens per expert over the valid rows and checks the valid input and output rows
finite, so that a served batch is one launch between its copies in and out (service/pipeline.py;
the service checks a request's values on the host only when its batch's input flag is down). The
padded rows' topk_ids are set to -1 on the device, so experts that can skip a pair
(`supports_expert_map`) spend nothing on them; other experts compute them and they are dropped.

An expert-parallel sender's forward is captured in three graphs (kernels/graph_capture.py): the
prologue before its broadcast and the epilogue after its reduce need no other rank, and the
service replays them on its copy streams (`replay_prologue`, `replay(..., ends=False)`,
`replay_epilogue`); `replay` alone runs all three in order.

`copies` independent sets of graphs (each with its own static inputs and outputs) let a batch
be copied into one set while the previous batch computes in another. Each copy has a memory
pool of its own, shared by its buckets' graphs (captured largest first, so the smaller ones
reuse its memory). A graph captured into a pool may keep its outputs where an earlier graph of
that pool had temporaries, so replaying the earlier one overwrites them: safe within a copy,
whose outputs are read before the copy's next replay, not across copies, whose outputs are
copied out while the next copy's graph runs (service/pipeline.py): with one pool for every
copy, a copy's outputs (a layer's routing ids, say) could be overwritten by another copy's
temporaries while they are copied out. The experts' buffers come from a private workspace
allocated inside the capture, never from the shared Workspace, whose buffers move when another
layer grows them. A batch-invariant layer's valid rows are untouched by the padding: its router
and shared-expert GEMMs run one fixed tile, its experts skip the padded pairs
(tests/kernels/test_batch_invariant_gpu.py).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from .arith import round_up
from .graph_capture import capturing_phases
from .input_checks import bit_rows
from .layer import LayerOutput, MoELayer
from .modular import ModularKernel
from .stages import HAS_TRITON, YES, Support
from .tensors import ForwardInputs, Routing
from .workspace import Workspace

if HAS_TRITON:
    from .row_kernels import batch_stats_into, zero_rows_from

log = logging.getLogger(__name__)


FINE_FROM = 64  # buckets double up to here, then grow by a quarter (in steps of this many)


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, ..., 64, then about 1.25x apart in multiples of 64 (128, 192, 256, 320, 448,
    576, 768, 960, ...), then `max_tokens`. Padded rows skip the experts but not the router and
    the shared experts: a batch of 269 tokens runs as 320 (doubling buckets would run it as 512)."""
    buckets, size = [], 1
    while size < max_tokens:
        buckets.append(size)
        if size < FINE_FROM:
            size *= 2
        else:
            size = round_up(size * 5 // 4, FINE_FROM)
    return (*buckets, max_tokens)


def zero_padding(
    rows: torch.Tensor, valid_rows: torch.Tensor, stats: torch.Tensor | None = None
) -> torch.Tensor:
    """rows [bucket, C] with rows from valid_rows (0-d, on the device) on zeroed, in place; on a
    GPU only those rows are touched (kernels/row_kernels.py). `stats` (int64 [E + 2]), where
    given, is reset to a replay's start: no tokens per expert, both finite flags up."""
    if HAS_TRITON and rows.is_cuda:
        return zero_rows_from(rows, valid_rows, stats)
    if stats is not None:
        stats.zero_()[-2:] = 1
    padded = torch.arange(rows.shape[0], device=rows.device) >= valid_rows
    return rows.masked_fill_(padded[:, None], 0)


def kernel_can_capture(kernel: ModularKernel, max_tokens: int) -> Support:
    """Whether `kernel`'s forwards of up to `max_tokens` tokens make no host sync, and why not."""
    for stage in (kernel.prepare_finalize, kernel.experts):
        if not stage.graph_capturable:
            return Support(False, f"{stage.name} cannot be captured (it syncs with the host)")
    limit = kernel.prepare_finalize.max_capture_tokens
    if limit is not None and max_tokens > limit:
        return Support(
            False,
            f"{kernel.prepare_finalize.name} syncs with the host above {limit} tokens "
            f"(graphs up to {max_tokens} asked for)",
        )
    return YES


def can_capture(layer: MoELayer, device: torch.device, max_tokens: int) -> Support:
    """Whether `layer` may run from whole-layer graphs of up to `max_tokens` tokens on `device`,
    and why not."""
    if device.type != "cuda":
        return Support(False, "CUDA graphs need a CUDA device")
    return kernel_can_capture(layer.kernel, max_tokens)


@dataclass(frozen=True)
class GraphOutput:
    """One replay's results: views of the graph's static buffers, valid until the next replay
    of the same copy."""

    output: LayerOutput  # output [m, H], routing [m, k]
    expert_tokens: torch.Tensor  # [E] int64 pairs per expert over the m valid rows
    finite: torch.Tensor  # [] int64: 1 if every valid output value is finite, else 0
    inputs_finite: torch.Tensor  # [] int64: 1 if every valid input value is finite, else 0
    stats: torch.Tensor  # [E + 2] int64: the three above in one buffer (one copy out)


@dataclass(frozen=True)
class GraphInputs:
    """One copy's static inputs, [max_tokens, ...]: a batch writes its rows [:m] and `valid_rows`
    (m), then replays."""

    hidden: torch.Tensor  # [max_tokens, H] in the layer's dtype
    logits: torch.Tensor | None  # [max_tokens, E] float32 (graphs that take client logits)
    valid_rows: torch.Tensor  # [] int64


@dataclass
class _Captured:
    # The forward's phases in order (kernels/graph_capture.py): one graph, or, for expert
    # parallelism's sender, a prologue before its first collective and an epilogue after its
    # last (neither needs another rank) around the collectives' part
    graphs: list[torch.cuda.CUDAGraph]
    output: LayerOutput  # [bucket, ...]
    stats: torch.Tensor  # [E + 2] int64: tokens per expert, output finite, inputs finite

    @property
    def prologue(self) -> list[torch.cuda.CUDAGraph]:
        return self.graphs[:1] if len(self.graphs) > 1 else []

    @property
    def epilogue(self) -> list[torch.cuda.CUDAGraph]:
        return self.graphs[-1:] if len(self.graphs) > 2 else []

    @property
    def main(self) -> list[torch.cuda.CUDAGraph]:
        return self.graphs[len(self.prologue) : len(self.graphs) - len(self.epilogue)]


class LayerGraphs:
    """One layer's graphs: `copies` sets of one graph per bucket, each set reading its own
    static input of the largest bucket.

    `with_logits`: the graphs take router logits from the client ([bucket, E] float32 input)
    instead of computing them with the stored router; a layer has one kind or the other.
    `input_rows`: static inputs of at least this many rows, for a caller that also runs larger
    batches from them eagerly (service/pipeline.py's slots, above a backend's capture limit).
    """

    def __init__(
        self,
        layer: MoELayer,
        device: torch.device,
        max_tokens: int,
        with_logits: bool,
        copies: int = 1,
        input_rows: int = 0,
    ) -> None:
        cfg = layer.cfg
        self.layer = layer
        self.device = device
        self.with_logits = with_logits
        self.buckets = token_buckets(max_tokens)
        top = max(self.buckets[-1], input_rows)  # the static inputs' rows

        def static_inputs() -> GraphInputs:
            logits = None
            if with_logits:
                logits = torch.zeros(top, cfg.num_experts, dtype=torch.float32, device=device)
            hidden = torch.zeros(top, cfg.hidden_size, dtype=cfg.dtype, device=device)
            return GraphInputs(hidden, logits, torch.zeros((), dtype=torch.int64, device=device))

        self.copies = copies
        self.inputs = [static_inputs() for _ in range(copies)]
        self.pools = [torch.cuda.graph_pool_handle() for _ in range(copies)]
        self._graphs: list[dict[int, _Captured]] = [{} for _ in range(copies)]

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def captured_buckets(self) -> list[int]:
        """The buckets captured in every copy, ascending."""
        return sorted(set.intersection(*(set(graphs) for graphs in self._graphs)))

    def bucket(self, tokens: int) -> int:
        """The smallest bucket holding `tokens` rows (tokens <= max_tokens)."""
        return self.buckets[bisect.bisect_left(self.buckets, tokens)]

    def capture(self) -> None:
        """Capture every bucket of every copy, largest first (the smaller ones then reuse its
        memory)."""
        with torch.cuda.device(self.device):  # the capture stream is the current device's
            for bucket in reversed(self.buckets):
                for copy, graphs in enumerate(self._graphs):
                    if bucket not in graphs:
                        graphs[bucket] = self._capture(copy, bucket)

    def _run(self, copy: int, bucket: int) -> tuple[LayerOutput, torch.Tensor]:
        static = self.inputs[copy]
        # allocated in the graph's pool while capturing; reset by the replay's first kernel
        stats = torch.empty(self.layer.cfg.num_experts + 2, dtype=torch.int64, device=self.device)
        hidden = zero_padding(static.hidden[:bucket], static.valid_rows, stats)
        logits = None
        if static.logits is not None:
            logits = zero_padding(static.logits[:bucket], static.valid_rows)
        private = Workspace(self.device)  # allocated in the graph's pool while capturing
        out = self.layer.forward(
            ForwardInputs(hidden, logits), valid_rows=static.valid_rows, workspace=private
        )
        inputs = [bit_rows(t) for t in (hidden, logits) if t is not None]
        batch_stats_into(
            stats, out.routing.topk_ids, static.valid_rows, bit_rows(out.output), inputs
        )  # experts may not skip the padded rows' pairs: counted from the valid rows only
        return out, stats

    def _capture(self, copy: int, bucket: int) -> _Captured:
        self.inputs[copy].valid_rows.fill_(bucket)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile and autotune outside the capture
            self._run(copy, bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        with capturing_phases(self.pools[copy]) as graphs:
            output, stats = self._run(copy, bucket)
        return _Captured(graphs, output, stats)

    def _captured(self, m: int, copy: int) -> _Captured:
        bucket = self.bucket(m)
        captured = self._graphs[copy].get(bucket)
        if captured is None:
            with torch.cuda.device(self.device):
                captured = self._graphs[copy][bucket] = self._capture(copy, bucket)
        return captured

    def replay_prologue(self, m: int, copy: int = 0) -> None:
        """Replay the prologue of copy `copy`'s graph for m rows on the current stream, where
        its forward has one (expert parallelism's sender: the router, the routing and the rows
        packed for the broadcast); else nothing."""
        for graph in self._captured(m, copy).prologue:
            graph.replay()

    def replay_epilogue(self, m: int, copy: int = 0) -> None:
        """Replay the epilogue of copy `copy`'s graph for m rows on the current stream (ordered
        after its `replay(..., ends=False)`), where its forward has one (expert parallelism's
        sender: the reduced sums rounded, the counts and the finite checks); else nothing."""
        for graph in self._captured(m, copy).epilogue:
            graph.replay()

    def replay(self, m: int, copy: int = 0, ends: bool = True) -> GraphOutput:
        """Replay copy `copy`'s graph for m rows (m <= max_tokens) on the current stream; its
        static inputs already hold the rows [:m] and valid_rows m (written on this stream, or
        ordered before it). `ends=False`: without its prologue, which already ran
        (`replay_prologue`), and epilogue, which the caller replays (`replay_epilogue`) before
        it reads the output."""
        captured = self._captured(m, copy)
        for graph in captured.graphs if ends else captured.main:
            graph.replay()
        out, e = captured.output, self.layer.cfg.num_experts
        routing = Routing(out.routing.topk_ids[:m], out.routing.topk_weights[:m])
        stats = captured.stats
        output = LayerOutput(out.output[:m], routing)
        return GraphOutput(output, stats[:e], stats[e], stats[e + 1], stats)

    def forward(self, inputs: ForwardInputs, copy: int = 0) -> GraphOutput:
        """inputs [m, H] (+ logits [m, E]) on the device, m <= max_tokens -> the replay's
        output, valid until the next call; runs on the current stream."""
        hidden, logits = inputs.hidden_states, inputs.router_logits
        if (logits is not None) != self.with_logits:
            raise ValueError(
                "these graphs take router logits" if self.with_logits else "these graphs route"
            )
        m = hidden.shape[0]
        static = self.inputs[copy]
        static.hidden[:m].copy_(hidden)
        if logits is not None:
            static.logits[:m].copy_(logits)
        static.valid_rows.fill_(m)
        return self.replay(m, copy)
