"""Expert parallelism over torch.distributed: all-gather the tokens, run the local experts on all
of them, reduce-scatter the partial outputs.

    rank r: hidden [M_r, K] -all-gather-> [M, K], M = sum of M_r -local experts-> partial [M, K]
            -reduce-scatter (sum over ranks)-> [M_r, K]

Each rank holds a slice of the experts (`kernels.placement`); `DispatchSpec.expert_map` turns
the gathered global ids into local ones (-1 elsewhere), so every (token, expert) pair is computed
on exactly one rank and the sum over ranks is the layer output.

Three ways of bringing tokens:
- equal (default): every rank brings the same M_r (data-parallel ranks padded alike), so the
  collectives run on fixed shapes without a host sync.
- sequence_parallel: ranks bring any M_r, 0 included. The counts are all-gathered first and
  rows padded to the largest count (two host syncs).
- sender (the service): one rank brings all M tokens, every other rank a placeholder of the same
  shape (it learnt M with the command that started the forward). The rows are broadcast from
  the sender and the partial outputs summed onto it (reduce): fixed shapes, no host sync, and
  each rank moves M rows instead of world * M.

`group` may be any ProcessGroup object, one made outside the default group included (the
service forms a new one among the live ranks when a rank dies); collectives are its methods.

What travels, packed into one byte buffer so a dispatch is one collective: the activations, the
global topk ids and the weights. The activations go as fp8 with their scales wherever the
experts compute in fp8 (`Experts.wire_quant`: also where they would quantise the 16-bit rows
themselves, as triton's do), quantised once on the rank that brings them: about half the bytes
of 16-bit rows, and the receiving ranks quantise nothing. The sender's broadcast carries them
end to end, each arriving as a view of the buffer (`pack_segments`); rows interleaved per token
would have to be copied apart again on every rank, in every forward. The ranks that receive it
compute nothing before it (`received_like`). An all-gather carries one byte row per token
(`pack_rows`), since it concatenates the ranks' rows. A per-tensor fp8 scale depends on every
token of the batch, which only a sender holds: in the other modes the 16-bit rows travel and the
gathered batch is quantised once, as on one GPU. Partial outputs are summed in float32, so the
sum over ranks rounds once, like the single-GPU combine.

The sender mode's reduce overlaps the experts' last GEMM: experts that can
(`Experts.sum_in_column_blocks`) compute GEMM2 and the top-k sum in blocks of output columns, and
each block's reduce starts as soon as it is queued, while the next block computes; only the last
block's reduce is left after the experts. Each block is a contiguous buffer of its own, as a
collective needs (`ColumnBlocks`). Small sums are reduced whole (`REDUCE_IN_BLOCKS_BYTES`).

Standard format only: batched-format experts regroup tokens per expert after prepare, which a
standard-format EP stage would have to redo; every scheme has a standard-format backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import ClassVar

import torch
import torch.distributed as dist

from ..arith import ceil_div, round_up
from ..graph_capture import phase_boundary
from ..quant_scheme import ActQuant
from ..quantize import quantize_activation
from ..routing import to_local_ids
from ..stages import (
    YES,
    ColumnBlocks,
    DispatchSpec,
    PrepareFinalize,
    SideOutput,
    SumTarget,
    Support,
    weighted_topk_sum,
)
from ..tensors import Dispatched, Format, Routing
from ..workspace import Workspace
from .no_ep import dispatch_locally, quantize_input

# Renamed in torch 2.13 (the old names warn there); older torch has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The sender mode reduces a float32 partial sum of at least this many bytes in REDUCE_BLOCKS
# column blocks (module doc). Below it a block's reduce is mostly latency, ahead of a GEMM that
# short anyway (DeepSeek-V3: from 1,171 tokens on).
REDUCE_IN_BLOCKS_BYTES = 32 << 20
REDUCE_BLOCKS = 2
# block edges on the weights' scale groups (fp8-block's 128 rows of w2)
BLOCK_COLUMNS_ALIGN = 128


def column_blocks(k: int, blocks: int) -> list[slice]:
    """K columns in `blocks` blocks of about equal width, each edge a multiple of
    BLOCK_COLUMNS_ALIGN (fewer blocks where K is narrow)."""
    width = round_up(ceil_div(k, blocks), BLOCK_COLUMNS_ALIGN)
    return [slice(start, min(start + width, k)) for start in range(0, k, width)]


_SEGMENT_ALIGN = 16  # bytes: every segment starts where any dtype can be viewed


def _segment_starts(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offset of each tensor's segment, and the bytes of them all (meta tensors too)."""
    starts, end = [], 0
    for t in tensors:
        starts.append(end)
        end += -(-t.nbytes // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
    return starts, end


def segments_bytes(tensors: list[torch.Tensor]) -> int:
    """The size of `pack_segments(tensors)`."""
    return _segment_starts(tensors)[1]


def pack_segments(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors -> one uint8 buffer holding each end to end (`unpack_segments` views them)."""
    packed = torch.empty(segments_bytes(tensors), dtype=torch.uint8, device=tensors[0].device)
    for view, t in zip(unpack_segments(packed, tensors), tensors, strict=True):
        view.copy_(t)
    return packed


def unpack_segments(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `packed` (from `pack_segments`) typed and shaped like `like`, no copy."""
    starts, _ = _segment_starts(like)
    return [
        packed[start : start + t.nbytes].view(t.dtype).view(t.shape)
        for start, t in zip(starts, like, strict=True)
    ]


def pack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors [R, ...] -> uint8 [R, total bytes per row]: one buffer, one collective."""
    return torch.cat([t.flatten(1).contiguous().view(torch.uint8) for t in tensors], dim=1)


def unpack_rows(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of `pack_rows`: rows of `packed` [R', bytes] as tensors typed and shaped like
    `like`'s rows ([R', ...])."""
    widths = [t.shape[1:].numel() * t.element_size() for t in like]
    parts = packed.split(widths, dim=1)
    return [
        p.contiguous().view(t.dtype).view(packed.shape[0], *t.shape[1:])
        for p, t in zip(parts, like, strict=True)
    ]


def received_like(
    hidden: torch.Tensor, routing: Routing, how: ActQuant | None
) -> list[torch.Tensor]:
    """Meta tensors shaped and typed as the sender's rows ((quantised) hidden, topk ids and
    weights, then the scales), for a rank that only receives them: nothing to compute."""
    rows = [hidden.to("meta"), routing.topk_ids.to("meta"), routing.topk_weights.to("meta")]
    if how is not None:  # the quantiser's shapes, from its torch twin
        q, scale = quantize_activation(rows[0], how)
        rows = [q, *rows[1:], scale]
    return rows


class NaiveEP(PrepareFinalize):
    name: ClassVar[str] = "naive-ep"
    format: ClassVar[Format] = Format.STANDARD
    # groups held outside torch.distributed's default group (service.ep counts its own)
    outside_groups: ClassVar[int] = 0

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        sender: int | None = None,
        wait: Callable[[dist.Work], None] | None = None,
    ) -> None:
        if sequence_parallel and sender is not None:
            raise ValueError("sequence_parallel and sender are two different modes")
        self.group = group  # None: the default (world) group
        self.sequence_parallel = sequence_parallel
        self.sender = sender  # the group rank that brings every token; None: every rank brings
        # how the sender mode waits for its collectives (the service's stops when a rank dies)
        self.wait = wait or (lambda work: work.wait())
        # fixed shapes and no host sync: CUDA graphs can hold its collectives (every rank
        # captures, then replays, the same bucket's graph)
        self.graph_capturable = sender is not None
        # tokens each rank brought to the chunk in flight: set by prepare, read by finalize
        # (the modular kernel runs them back to back)
        self._counts: list[int] = []
        # the sender's broadcast of the chunk in flight, joined before its reduce (broadcast)
        self._sending: dist.Work | None = None
        # the chunk's partial sum in column blocks, and the reduces of those queued so far
        self._blocks: ColumnBlocks | None = None
        self._reducing: list[dist.Work] = []

    @classmethod
    def supports(cls, device: torch.device) -> Support:  # noqa: ARG003
        if not (dist.is_available() and (dist.is_initialized() or cls.outside_groups)):
            return Support(False, "needs an initialised torch.distributed process group")
        return YES

    @property
    def world_size(self) -> int:
        return self._group().size()

    def _group(self) -> dist.ProcessGroup:
        return dist.group.WORLD if self.group is None else self.group

    def planned_tokens(self, hidden: torch.Tensor) -> int:
        if not self.sequence_parallel:
            return hidden.shape[0]
        m = torch.tensor([hidden.shape[0]], dtype=torch.int64, device=hidden.device)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
        return int(m.item())

    def prepare(
        self,
        hidden: torch.Tensor,
        routing: Routing,
        spec: DispatchSpec,
        ws: Workspace,  # noqa: ARG002
    ) -> Dispatched:
        # a chunk that failed midway (a rank died) leaves nothing to this one: the service
        # points this stage at the survivors' group and goes on with it
        self._sending, self._blocks, self._reducing = None, None, []
        # Quantised before sending: fewer bytes travel. A per-tensor scale depends on every
        # token of the batch, which only a sender holds.
        how = spec.wire_quant
        if how == ActQuant.TENSOR and self.sender is None:
            how = None
        receives = self.sender is not None and self._group().rank() != self.sender
        if receives:
            rows = received_like(hidden, routing, how)
        else:
            local = dispatch_locally(hidden, routing, replace(spec, expert_map=None, act_quant=how))
            rows = [local.hidden, local.topk_ids, local.topk_weights]
            if how is not None:
                rows.append(local.scale)
        if self.sender is not None:
            if receives:  # the broadcast fills it
                packed = torch.empty(segments_bytes(rows), dtype=torch.uint8, device=hidden.device)
            else:
                packed = pack_segments(rows)
            # All so far needs no other rank: a capture may end its first graph here, which the
            # service runs ahead, beside the previous batch's forward (graph_capture.py)
            phase_boundary()
            gathered = unpack_segments(self.broadcast(packed), rows)
        else:
            gathered = unpack_rows(self.all_gather(pack_rows(rows)), rows)
        x, ids, weights = gathered[:3]
        scale = gathered[3] if how is not None else None
        if how is None and spec.act_quant is not None:  # the gathered batch, as on one GPU
            x, scale = quantize_input(x, spec.act_quant)
            how = spec.act_quant
        return Dispatched(x, scale, how, to_local_ids(ids, spec.expert_map), weights)

    def sum_target(
        self,
        x: Dispatched,
        out: torch.Tensor,
        extra: SideOutput | None,
        ws: Workspace,
        spec: DispatchSpec,
    ) -> SumTarget:
        """This rank's float32 partial sum over every rank's tokens [M, K], so the ranks' sum
        rounds once. The sender adds its shared experts' output there, before the reduce: the
        tail after the reduce is one rounding pass. In the other modes a rank's shared output
        belongs to its own rows, which only the reduce-scatter brings back: finalize adds it.
        The sender mode takes a large sum in column blocks, where the experts can (module doc)."""
        m, k = x.num_tokens, out.shape[1]
        if self.sender is None:
            return SumTarget(ws.get("naive_ep_partial", (m, k), torch.float32))
        if not spec.column_blocks or m * k * 4 < REDUCE_IN_BLOCKS_BYTES:
            return SumTarget(ws.get("naive_ep_partial", (m, k), torch.float32), extra)
        flat = ws.get("naive_ep_partial", (m * k,), torch.float32)
        parts = tuple(
            flat[m * c.start : m * c.stop].view(m, -1) for c in column_blocks(k, REDUCE_BLOCKS)
        )
        self._blocks = ColumnBlocks(parts, self._reduce_block)
        return SumTarget(self._blocks, extra)

    def _reduce_block(self, b: int) -> None:
        """Block b of the partial sum is queued: its reduce onto the sender starts after it."""
        assert self._blocks is not None  # set by sum_target, for this chunk
        self._join_broadcast()
        self._reducing.append(
            self._group().reduce(self._blocks.parts[b], self.sender, dist.ReduceOp.SUM)
        )

    def _join_broadcast(self) -> None:
        """The sender's broadcast, long done by the time the reduce queues: joining it costs
        nothing and closes the capture's fork."""
        if self._sending is not None:
            sending, self._sending = self._sending, None
            self.wait(sending)

    def combine(
        self, expert_out: torch.Tensor | ColumnBlocks, x: Dispatched, reduce: bool
    ) -> torch.Tensor | ColumnBlocks | None:
        if self._blocks is not None:  # reduced block by block as the experts wrote them
            summed, reducing = self._blocks, self._reducing
            self._blocks, self._reducing = None, []
            for work in reducing:
                self.wait(work)
        else:
            partial = (
                weighted_topk_sum(expert_out, x.topk_ids, x.topk_weights)
                if reduce
                else expert_out.float()
            )  # [M, K] float32, this rank's experts only
            if self.sender is None:
                return self.reduce_scatter(partial)
            summed = self.reduce_to_sender(partial)
        # the sum lands on the sender; elsewhere out is a placeholder no one reads
        # All after the reduce needs no other rank: a capture may begin its last graph here,
        # which the service runs on its copy-out stream as the next broadcast begins
        phase_boundary()
        return summed if self._group().rank() == self.sender else None

    def reduce_to_sender(self, partial: torch.Tensor) -> torch.Tensor:
        """Every rank's partial sums [M, K] -> their sum on the sender (in place)."""
        self._join_broadcast()
        self.wait(self._group().reduce(partial, self.sender, dist.ReduceOp.SUM))
        return partial

    def broadcast(self, rows: torch.Tensor) -> torch.Tensor:
        """The sender's buffer onto every rank (others bring a buffer of the same shape).

        The sender's rows are already its own, and the broadcast only reads them: its experts
        start while the rows travel (they only read them too), and it joins the broadcast before
        its reduce. The other ranks wait for their rows."""
        work = self._group().broadcast(rows, self.sender)
        if self._group().rank() == self.sender:
            self._sending = work
        else:
            self.wait(work)
        return rows

    def all_gather(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows [M_r, B] -> every rank's rows [M, B], in rank order."""
        world = self.world_size
        if not self.sequence_parallel:
            self._counts = [rows.shape[0]] * world
            out = rows.new_empty((world * rows.shape[0], rows.shape[1]))
            _all_gather_single(out, rows, group=self.group)
            return out
        count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
        counts = count.new_empty(world)
        _all_gather_single(counts, count, group=self.group)
        self._counts = counts.tolist()
        longest = max(self._counts)
        padded = rows.new_zeros((longest, rows.shape[1]))
        padded[: rows.shape[0]] = rows
        out = rows.new_empty((world * longest, rows.shape[1]))
        _all_gather_single(out, padded, group=self.group)
        out = out.view(world, longest, -1)
        return torch.cat([out[r, :c] for r, c in enumerate(self._counts)])

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Every rank's partial sums [M, K] -> the sum over ranks of this rank's rows [M_r, K]
        (sequence_parallel: [max M_r, K], rows past this rank's count are padding)."""
        longest = max(self._counts)
        if self.sequence_parallel:
            padded = partial.new_zeros((self.world_size, longest, partial.shape[1]))
            for r, rows in enumerate(partial.split(self._counts)):
                padded[r, : rows.shape[0]] = rows
            partial = padded.view(-1, partial.shape[1])
        out = partial.new_empty((longest, partial.shape[1]))
        _reduce_scatter_single(out, partial, group=self.group)
        return out
