"""Our Triton experts: GEMM1 (+ bias, gated activation) -> GEMM2 (+ bias, router weight), for
every quant scheme, in the standard (`triton`) and batched (`triton-batched`) formats.

Standard format, for M tokens and P = M * k (token, slot) pairs:
    aligned = align_pairs(topk_ids)           # pair ids sorted by expert, runs padded to BLOCK_M
                                              # (per-pair tiles: none, one GEMV per pair)
    h[p] = act(x[p // k] @ W13[e_p].T + b13)  # [P, I], input rows gathered, never permuted
    h    = quant(h) over all pairs            # fp8 schemes, as the reference does
    y[p] = w_p * (h[p] @ W2[e_p].T + b2)      # [P, H]
    out[t] = sum over the token's local slots of y   # [M, H]
                                              # (per pair: summed as GEMM2 writes, y never stored)
The batched format runs the same two GEMMs over the valid rows of [E, max_tokens, K] and leaves
weight-and-reduce to finalize. Kernel bodies are in kernels/experts/_triton/.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from ..config import MoEConfig
from ..quant_scheme import ActQuant, QuantScheme
from ..stages import (
    HAS_TRITON,
    NO_TRITON,
    YES,
    ColumnBlocks,
    Experts,
    SumTarget,
    Support,
    cuda_capability,
)
from ..tensors import Dispatched, ExpertWeights, Format
from ..workspace import Workspace

if HAS_TRITON:  # without it the backends stay registered and say why they cannot run
    from ._triton.align import AlignedPairs, align_pairs
    from ._triton.gemv import MAX_PAIRS, EachPair, SlotSum, pair_gemv
    from ._triton.graphs import MAX_GRAPH_TOKENS, DecodeGraphs
    from ._triton.grouped_gemm import (
        Activations,
        BatchedRows,
        Epilogue,
        ExpertMatrix,
        grouped_gemm,
    )
    from ._triton.quantize import quantize_rows
    from ._triton.tiles import (
        INVARIANT_TOKENS,
        LayerTiles,
        nested_block_k,
        tiles_for,
    )
    from ._triton.topk_sum import topk_sum

_FP8_CAPABILITY = (8, 9)  # fp8 tensor-core dots: Ada and Hopper onwards


class _TritonBase(Experts):
    # each has a path through the grouped GEMM (codes.weight_kind) and a test in test_triton.py
    schemes: ClassVar[frozenset[QuantScheme]] = frozenset({
        QuantScheme.NONE, QuantScheme.FP8_TENSOR, QuantScheme.FP8_TOKEN, QuantScheme.FP8_BLOCK,
        QuantScheme.INT8_W8A16, QuantScheme.INT4_W4A16, QuantScheme.MXFP4,
    })  # fmt: skip
    has_invariant_mode: ClassVar[bool] = True
    runs_per_pair: ClassVar[bool] = False  # per-pair GEMVs (standard format only)

    def __init__(
        self,
        cfg: MoEConfig,
        weights: ExpertWeights,
        fixed_tiles: LayerTiles | None = None,
        batch_invariant: bool = False,
    ) -> None:
        super().__init__(cfg, weights, batch_invariant)
        # `moe-serve bench tune` times candidates; None: the tuned file or the heuristic
        self.fixed_tiles = fixed_tiles
        self.w13 = ExpertMatrix(weights.w13, weights.w13_scale, weights.w13_bias, cfg.quant)
        self.w2 = ExpertMatrix(weights.w2, weights.w2_scale, weights.w2_bias, cfg.quant)

    @classmethod
    def environment(cls, device: torch.device) -> Support:
        if not HAS_TRITON:
            return NO_TRITON
        if cuda_capability(device) is None:
            return Support(False, f"needs a CUDA GPU, {device} has none")
        return YES

    @classmethod
    def check_config(cls, cfg: MoEConfig) -> Support:
        if not nested_block_k(cfg, 128):
            return Support(False, f"int4 group_size {cfg.quant.group_size} does not nest with "
                           "power-of-two K tiles (use a multiple or divisor of 16)")  # fmt: skip
        return YES

    @classmethod
    def supports(cls, cfg: MoEConfig | None, device: torch.device) -> Support:
        support = super().supports(cfg, device)
        capability = cuda_capability(device)
        needs_fp8 = cfg is not None and cfg.quant.spec.act_quant is not None
        if support and needs_fp8 and capability < _FP8_CAPABILITY:
            return Support(False, f"fp8 dots need compute capability 8.9+, got {capability}")
        return support

    def tiles(self, num_tokens: int, device: torch.device) -> LayerTiles:
        """Tile sizes for a call of `num_tokens` tokens; batch-invariant: one set at every M,
        so each row's dots sum in one order (no tile here splits K, none runs per pair)."""
        if self.batch_invariant:
            num_tokens = INVARIANT_TOKENS
        per_pair = (
            self.runs_per_pair
            and not self.batch_invariant
            and num_tokens * self.cfg.top_k <= MAX_PAIRS
        )
        return self.fixed_tiles or tiles_for(self.cfg, num_tokens, device, per_pair)

    @property
    def fp8_quant(self) -> ActQuant | None:
        """How this scheme quantises the GEMM inputs to fp8 (None: 16-bit activations)."""
        return self.cfg.quant.spec.act_quant

    @property
    def intermediate_dtype(self) -> torch.dtype:
        # fp8 schemes quantise the intermediate from float32, exactly as the reference does
        return torch.float32 if self.fp8_quant else self.cfg.dtype

    def _gemm1(
        self,
        a: Activations,
        rows: AlignedPairs | BatchedRows | EachPair,
        h: torch.Tensor,
        tiles: LayerTiles,
        pair_ids: torch.Tensor | None,
    ) -> Activations:
        """GEMM1 + activation into h [R, I] -> GEMM2's input (h, quantised if the scheme does)."""
        how = self.fp8_quant
        amax = None
        if how == ActQuant.TENSOR:  # one scale over the rows GEMM1 writes, found as it writes
            amax = torch.zeros(1, dtype=torch.float32, device=h.device)
            pair_ids = None  # every row is quantised; GEMM2 reads only those GEMM1 wrote
        gemm = pair_gemv if isinstance(rows, EachPair) else grouped_gemm
        gemm(a, self.w13, h, rows, Epilogue(gate_up=self.cfg.activation, amax=amax), tiles.gemm1)
        if how is None:
            return Activations(h)
        # only the rows of pairs GEMM1 wrote: no GEMM reads the others
        return Activations(*quantize_rows(h, how, pair_ids, amax), how)


class TritonExperts(_TritonBase):
    name: ClassVar[str] = "triton"
    format: ClassVar[Format] = Format.STANDARD
    reduces_topk: ClassVar[bool] = True
    sum_in_column_blocks: ClassVar[bool] = True
    # fp8 schemes: the input is quantised here, by one Triton pass that decode graphs capture
    takes_quantized_input: ClassVar[bool] = False
    graph_capturable: ClassVar[bool] = True  # align, GEMMs and top-k sum never sync the host
    runs_per_pair: ClassVar[bool] = True

    def wire_quant(self) -> ActQuant | None:
        return self.fp8_quant  # rows quantised already skip this stage's own quantiser

    def workspace_shapes(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        cfg = self.cfg
        pairs = num_tokens * cfg.top_k
        shapes = {"triton_intermediate": ((pairs, cfg.intermediate_size), self.intermediate_dtype)}
        if not self.tiles(num_tokens, self.weights.w13.device).per_pair:  # per pair: GEMM2 sums
            shapes["triton_pair_out"] = ((pairs, cfg.hidden_size), cfg.dtype)
        return shapes

    def apply(self, x: Dispatched, ws: Workspace, into: SumTarget | None = None) -> torch.Tensor:
        # not inside a whole-layer capture (kernels/layer_graphs.py): graphs do not nest
        capturing = x.hidden.is_cuda and torch.cuda.is_current_stream_capturing()
        if x.hidden.is_cuda and 0 < x.num_tokens <= MAX_GRAPH_TOKENS and not capturing:
            summed = self.graphs(x)  # float32, unrounded: adding extra here rounds once
            return summed if into is None else into.write(summed)
        shapes = self.workspace_shapes(x.num_tokens)
        return self._forward(x, {name: ws.get(name, *spec) for name, spec in shapes.items()}, into)

    @functools.cached_property
    def graphs(self) -> DecodeGraphs:
        def forward(x: Dispatched) -> torch.Tensor:  # buffers of the graph's own pool
            shapes = self.workspace_shapes(x.num_tokens).items()
            buf = {name: torch.empty(shape, dtype=dtype, device=x.hidden.device)
                   for name, (shape, dtype) in shapes}  # fmt: skip
            return self._forward(x, buf)

        return DecodeGraphs(forward)

    def _forward(
        self, x: Dispatched, buf: dict[str, torch.Tensor], into: SumTarget | None = None
    ) -> torch.Tensor:
        """The eager forward through the `workspace_shapes` buffers `buf` -> into.out [M, H]
        (None: a new float32 [M, H])."""
        m, k = x.topk_ids.shape
        tiles = self.tiles(m, x.hidden.device)
        pair_ids = x.topk_ids.flatten()
        if tiles.per_pair:
            rows = EachPair(pair_ids)
        else:
            rows = align_pairs(x.topk_ids, self.weights.num_experts, tiles.block_m)
        hidden, scale, how = x.hidden, x.scale, x.act_quant
        if how is None and self.fp8_quant is not None:
            how = self.fp8_quant
            hidden, scale = quantize_rows(hidden, how)
        a = Activations(hidden, scale, how, pairs_per_row=k)
        row_weights = x.topk_weights.float().flatten().contiguous()  # [P]
        if into is None:
            into = SumTarget(torch.empty(m, self.cfg.hidden_size, device=x.hidden.device))
        second = self._gemm1(a, rows, buf["triton_intermediate"], tiles, pair_ids)
        if not isinstance(into.out, ColumnBlocks):
            self._gemm2(second, rows, x.topk_ids, buf, tiles, row_weights, into, into.out)
            return into.out
        # GEMM2 and the sum block by block, each block handed on (to a collective) before the
        # next is computed; each output element is computed as without blocks
        for b, cols, part in into.out.blocks():
            self._gemm2(second, rows, x.topk_ids, buf, tiles, row_weights, into, part, cols)
            into.out.written(b)
        return into.out

    def _gemm2(
        self,
        second: Activations,
        rows: AlignedPairs | EachPair,
        topk_ids: torch.Tensor,  # [M, k] local ids, -1 not here
        buf: dict[str, torch.Tensor],
        tiles: LayerTiles,
        row_weights: torch.Tensor,  # [P] float32
        into: SumTarget,  # its extra
        out: torch.Tensor,  # [M, cols]: into.out or one of its column blocks
        cols: slice | None = None,  # w2's rows (None: all)
    ) -> None:
        """GEMM2 (+ router weight) and each token's sum over its slots (+ extra) into out. Per
        pair, one launch that sums as it writes (its programs take a token each); else GEMM2
        into the pair_out workspace and then the top-k sum, which alone waits for extra."""
        w2 = self.w2 if cols is None else self.w2.n_slice(cols)
        epilogue = Epilogue(row_weights=row_weights)
        if isinstance(rows, EachPair):
            extra = _columns(into.ready_extra(), cols)
            pair_gemv(
                second, w2, out, rows, epilogue, tiles.gemm2, SlotSum(topk_ids.shape[1], extra)
            )
            return
        y = buf["triton_pair_out"] if cols is None else buf["triton_pair_out"][:, cols]
        grouped_gemm(second, w2, y, rows, epilogue, tiles.gemm2)
        topk_sum(y, topk_ids, out, _columns(into.ready_extra(), cols))


def _columns(t: torch.Tensor | None, cols: slice | None) -> torch.Tensor | None:
    return t if t is None or cols is None else t[:, cols]


class TritonBatchedExperts(_TritonBase):
    name: ClassVar[str] = "triton-batched"
    format: ClassVar[Format] = Format.BATCHED
    graph_capturable: ClassVar[bool] = True  # blocks past an expert's count exit on the device

    def apply(self, x: Dispatched, ws: Workspace) -> torch.Tensor:
        cfg = self.cfg
        num_experts, max_tokens, hidden = x.hidden.shape
        rows = num_experts * max_tokens
        tiles = self.tiles(x.num_tokens, x.hidden.device)
        scale = x.scale
        if scale is not None and x.act_quant != ActQuant.TENSOR:
            scale = scale.reshape(rows, -1)  # [E, max_tokens, G] -> [E * max_tokens, G]
        a = Activations(x.hidden.reshape(rows, hidden), scale, x.act_quant)
        h = ws.get("triton_batched_intermediate", (rows, cfg.intermediate_size),
                   self.intermediate_dtype)  # fmt: skip
        out = ws.get("triton_batched_out", (num_experts, max_tokens, cfg.hidden_size), cfg.dtype)
        batched = BatchedRows(x.tokens_per_expert, max_tokens, tiles.block_m)
        second = self._gemm1(a, batched, h, tiles, None)
        grouped_gemm(
            second, self.w2, out.view(rows, cfg.hidden_size), batched, Epilogue(), tiles.gemm2
        )
        return out
