"""Whole-layer CUDA graphs: router GEMM, routing, experts and shared experts captured once per
token bucket, so a forward costs one graph launch however many kernels the backend launches.

    forward(hidden [m, H]) -> copy into the static input, zero rows m..bucket, replay
                              the bucket's graph -> views of its static outputs [:m]

Padded rows are zeros, and their topk_ids are set to -1 on the device, so experts that can skip
a pair (`supports_expert_map`) spend nothing on them; other experts compute them and they are
dropped. A batch-invariant layer's valid rows are untouched by the padding: its router and
shared-expert GEMMs run one fixed tile, its experts skip the padded pairs
(tests/kernels/test_batch_invariant_gpu.py). Every graph of a layer shares one memory pool:
they never run at once, so each graph's temporaries reuse the others' (captured largest
first). The experts' buffers come from a private workspace allocated inside the capture, never
from the shared Workspace, whose buffers move when another layer grows them.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from kernels.arith import round_up
from kernels.layer import LayerOutput, MoELayer, expert_tokens, mask_rows
from kernels.stages import YES, Support
from kernels.tensors import ForwardInputs, Routing
from kernels.workspace import Workspace

log = logging.getLogger(__name__)


FINE_FROM = 64  # buckets double up to here, then grow by a quarter (in steps of this many)


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, ..., 64, then about 1.25x apart in multiples of 64 (128, 192, 256, 320, 448,
    576, 768, 960, ...), then `max_tokens`. Padded rows skip the experts but not the router and
    the shared experts: a batch of 269 tokens ran as 512 with doubling buckets, now as 320."""
    buckets, size = [], 1
    while size < max_tokens:
        buckets.append(size)
        if size < FINE_FROM:
            size *= 2
        else:
            size = round_up(size * 5 // 4, FINE_FROM)
    return (*buckets, max_tokens)


def can_capture(layer: MoELayer, device: torch.device) -> Support:
    """Whether `layer` may run from whole-layer graphs on `device`, and why not."""
    if device.type != "cuda":
        return Support(False, "CUDA graphs need a CUDA device")
    for stage in (layer.kernel.prepare_finalize, layer.kernel.experts):
        if not stage.graph_capturable:
            return Support(False, f"{stage.name} cannot be captured (it syncs with the host)")
    return YES


@dataclass(frozen=True)
class GraphOutput:
    """One replay's results: views of the graph's static buffers, valid until the next replay."""

    output: LayerOutput  # output [m, H], routing [m, k]
    expert_tokens: torch.Tensor  # [E] int64 pairs per expert over the m valid rows


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    output: LayerOutput  # [bucket, ...]
    expert_tokens: torch.Tensor  # [E]


class LayerGraphs:
    """One layer's graphs, one per bucket, all reading one static input of the largest bucket.

    `with_logits`: the graphs take router logits from the client ([bucket, E] float32 input)
    instead of computing them with the stored router; a layer has one kind or the other.
    """

    def __init__(
        self, layer: MoELayer, device: torch.device, max_tokens: int, with_logits: bool
    ) -> None:
        cfg = layer.cfg
        self.layer = layer
        self.device = device
        self.with_logits = with_logits
        self.buckets = token_buckets(max_tokens)
        top = self.buckets[-1]
        self.hidden = torch.zeros(top, cfg.hidden_size, dtype=cfg.dtype, device=device)
        self.logits = (
            torch.zeros(top, cfg.num_experts, dtype=torch.float32, device=device)
            if with_logits
            else None
        )
        self.valid_rows = torch.zeros((), dtype=torch.int64, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Captured] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket(self, tokens: int) -> int:
        """The smallest bucket holding `tokens` rows (tokens <= max_tokens)."""
        return self.buckets[bisect.bisect_left(self.buckets, tokens)]

    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones then reuse its memory)."""
        with torch.cuda.device(self.device):  # the capture stream is the current device's
            for bucket in reversed(self.buckets):
                if bucket not in self.graphs:
                    self.graphs[bucket] = self._capture(bucket)

    def _run(self, bucket: int) -> tuple[LayerOutput, torch.Tensor]:
        logits = None if self.logits is None else self.logits[:bucket]
        inputs = ForwardInputs(self.hidden[:bucket], logits)
        private = Workspace(self.device)  # allocated in the graph's pool while capturing
        out = self.layer.forward(inputs, valid_rows=self.valid_rows, workspace=private)
        valid_ids = mask_rows(out.routing.topk_ids, self.valid_rows)  # experts may not skip
        return out, expert_tokens(valid_ids, self.layer.cfg.num_experts)

    def _capture(self, bucket: int) -> _Captured:
        self.valid_rows.fill_(bucket)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile and autotune outside the capture
            self._run(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the device worker's other threads may wait on events meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output, counts = self._run(bucket)
        return _Captured(graph, output, counts)

    def forward(self, inputs: ForwardInputs) -> GraphOutput:
        """inputs [m, H] (+ logits [m, E]) on the device, m <= max_tokens -> the replay's
        output, valid until the next call; runs on the current stream."""
        hidden, logits = inputs.hidden_states, inputs.router_logits
        if (logits is not None) != self.with_logits:
            raise ValueError(
                "these graphs take router logits" if self.with_logits else "these graphs route"
            )
        m = hidden.shape[0]
        bucket = self.bucket(m)
        captured = self.graphs.get(bucket)
        if captured is None:
            with torch.cuda.device(self.device):
                captured = self.graphs[bucket] = self._capture(bucket)
        self.hidden[:m].copy_(hidden)
        self.hidden[m:bucket].zero_()
        if logits is not None:
            self.logits[:m].copy_(logits)
            self.logits[m:bucket].zero_()
        self.valid_rows.fill_(m)
        captured.graph.replay()
        out = captured.output
        routing = Routing(out.routing.topk_ids[:m], out.routing.topk_weights[:m])
        return GraphOutput(LayerOutput(out.output[:m], routing), captured.expert_tokens)
