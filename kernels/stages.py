"""The two stages a modular kernel composes, and how each says whether it can run here.

    [route] -> [prepare: quantise, dispatch] -> [experts: GEMM1 -> act -> GEMM2] -> [finalize]

`PrepareFinalize` owns both ends of the data movement (they must agree on the layout, e.g. the
two halves of a collective). `Experts` owns the math. Exactly one of them weighs each expert's
output by its router weight and sums over top-k: the experts when `reduces_topk`, else finalize.
The shared experts' float32 output joins that sum before its one rounding to the layer's dtype:
experts that reduce top-k add it in their own sum's pass (`SumTarget`), else finalize adds it.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from .config import Activation, MoEConfig
from .quant_scheme import ActQuant, QuantScheme
from .tensors import Dispatched, ExpertWeights, Format, Routing
from .workspace import Workspace


@dataclass(frozen=True)
class Support:
    """An answer to "can this run here?", with the reason when it cannot."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


YES = Support(True)


def resolve_device(name: str) -> torch.device:
    """The device `name` (auto, cpu, cuda, cuda:N) means: `auto` is the first GPU when there is
    one, else the CPU. A GPU asked for where none is visible is a ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"not a device: {name!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but no CUDA GPU is visible")
    return device


# triton ships with CUDA builds of torch; without it the Triton paths say why they cannot run
HAS_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = Support(False, "triton is not installed (pip install 'moe-serve[gpu]')")


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


@dataclass(frozen=True)
class SideOutput:
    """A tensor another CUDA stream writes (the shared experts' output, computed beside the
    router and the routed experts): `ready` fires once it is written; None: it already is, in
    the reader's stream order (the CPU, or no side stream)."""

    value: torch.Tensor
    ready: torch.cuda.Event | None = None

    def rows(self, rows: slice) -> SideOutput:
        return SideOutput(self.value[rows], self.ready)

    def wait(self) -> torch.Tensor:
        """The value, for work queued from now on: the current stream waits for the writer."""
        if self.ready is not None:
            torch.cuda.current_stream(self.value.device).wait_event(self.ready)
        return self.value


@dataclass(frozen=True)
class ColumnBlocks:
    """A sum [M, K] held as blocks of whole columns, each a contiguous [M, K_b] of its own, so
    that a collective can take one block while the experts compute the next (naive-ep's
    reduce). `written(b)` is called once block b is queued whole: work queued after the call
    reads it complete (stream order)."""

    parts: tuple[torch.Tensor, ...]
    written: Callable[[int], None]

    def blocks(self) -> Iterator[tuple[int, slice, torch.Tensor]]:
        """(b, block b's columns of the sum, block b), in order."""
        start = 0
        for b, part in enumerate(self.parts):
            yield b, slice(start, start + part.shape[1]), part
            start += part.shape[1]


@dataclass(frozen=True)
class SumTarget:
    """Where experts that reduce top-k write each token's weighted sum: `out` [M, K], the layer's
    dtype or float32 (a partial sum other ranks' partial sums are added to), with `extra`
    (float32 [M, K], the shared experts' output) added in float32 before the one rounding.
    `out` is in column blocks only for experts that `sum_in_column_blocks`."""

    out: torch.Tensor | ColumnBlocks
    extra: SideOutput | None = None

    def ready_extra(self) -> torch.Tensor | None:
        """extra's value for the pass about to be queued (which then runs after its writer)."""
        return None if self.extra is None else self.extra.wait()

    def write(self, summed: torch.Tensor | ColumnBlocks) -> torch.Tensor | ColumnBlocks:
        """summed [M, K] (+ extra) into out in one pass, rounded once; returns out. For a sum
        made elsewhere (experts without a pass of their own, finalize after a collective)."""
        extra = self.ready_extra()
        if isinstance(self.out, ColumnBlocks):
            for b, cols, part in self.out.blocks():
                _sum_into(summed[:, cols], _columns(extra, cols), part)
                self.out.written(b)
        elif isinstance(summed, ColumnBlocks):
            for _, cols, part in summed.blocks():
                _sum_into(part, _columns(extra, cols), self.out[:, cols])
        else:
            _sum_into(summed, extra, self.out)
        return self.out


def _columns(t: torch.Tensor | None, cols: slice) -> torch.Tensor | None:
    return None if t is None else t[:, cols]


def _sum_into(summed: torch.Tensor, extra: torch.Tensor | None, out: torch.Tensor) -> None:
    if extra is not None:
        torch.add(summed, extra, out=out)
    elif summed.data_ptr() != out.data_ptr():
        out.copy_(summed)


@dataclass(frozen=True)
class DispatchSpec:
    """What prepare must do for one (layer, experts) pair; fixed when the kernel is built."""

    act_quant: ActQuant | None  # quantise activations to fp8 before dispatch
    num_local_experts: int
    # [E_global] -> local id or -1, or a replica map [E_global, 1 + C] (kernels.placement)
    expert_map: torch.Tensor | None = None
    apply_router_weight_on_input: bool = False
    # what a dispatch that moves the rows may quantise them to first, so fewer bytes travel
    # (Experts.wire_quant); None: they travel as they are, quantised after (act_quant)
    wire_quant: ActQuant | None = None
    # the experts can write their sum in column blocks (Experts.sum_in_column_blocks)
    column_blocks: bool = False


class Experts(ABC):
    """GEMM1 -> activation -> GEMM2 over the experts of one layer; built once per layer."""

    name: ClassVar[str]
    format: ClassVar[Format]
    schemes: ClassVar[frozenset[QuantScheme]]
    activations: ClassVar[frozenset[Activation]] = frozenset(Activation)
    devices: ClassVar[frozenset[str]] = frozenset({"cuda"})
    supports_expert_map: ClassVar[bool] = True
    supports_chunking: ClassVar[bool] = True
    reduces_topk: ClassVar[bool] = False  # True: apply() returns [M, K], weighted and summed
    # reduces_topk only. True: apply() takes a SumTarget in ColumnBlocks, and calls each block's
    # `written` as soon as it is queued, before computing the next (ColumnBlocks)
    sum_in_column_blocks: ClassVar[bool] = False
    takes_quantized_input: ClassVar[bool] = True  # False: prepare leaves activations 16-bit
    # True: apply() makes no host sync and no data-dependent host decision, so a whole-layer
    # forward can be captured in a CUDA graph and replayed (kernels/layer_graphs.py)
    graph_capturable: ClassVar[bool] = False
    # True: built with batch_invariant=True, each row's output is independent of the other rows
    # and of the chunking (kernels/batch_invariant.py); standard format only
    has_invariant_mode: ClassVar[bool] = False

    def __init__(
        self, cfg: MoEConfig, weights: ExpertWeights, batch_invariant: bool = False
    ) -> None:
        self.cfg = cfg
        self.weights = weights
        self.batch_invariant = batch_invariant

    @classmethod
    def batch_invariance(cls, cfg: MoEConfig | None) -> Support:
        """Can this backend run `cfg` (None: some layer) so that a row's output does not depend
        on the rest of its batch?"""
        if cls.format != Format.STANDARD:
            return Support(
                False,
                "the batched format's rows per expert and its experts' tiles follow the batch size",
            )
        if not cls.has_invariant_mode:
            return Support(False, "no batch-invariant mode: its kernels change with the batch size")
        if cfg is not None and cfg.quant.spec.act_quant == ActQuant.TENSOR:
            return Support(
                False,
                f"{cfg.quant.scheme} quantises the activations with one scale over the whole "
                "batch, so every row's output depends on the others (fp8-token and fp8-block "
                "scale each row)",
            )
        return YES

    @classmethod
    def environment(cls, device: torch.device) -> Support:  # noqa: ARG003
        """Can this backend run on `device` at all (packages, GPU generation)?"""
        return YES

    @classmethod
    def check_config(cls, cfg: MoEConfig) -> Support:  # noqa: ARG003
        """Backend-specific limits on the layer's shape, beyond scheme and activation."""
        return YES

    @classmethod
    def supports(cls, cfg: MoEConfig | None, device: torch.device) -> Support:
        if device.type not in cls.devices:
            return Support(False, f"runs on {'/'.join(sorted(cls.devices))}, not {device.type}")
        env = cls.environment(device)
        if not env or cfg is None:
            return env
        if cfg.quant.scheme not in cls.schemes:
            return Support(False, f"quant scheme {cfg.quant.scheme} not supported")
        if cfg.activation.kind not in cls.activations:
            return Support(False, f"activation {cfg.activation.kind} not supported")
        return cls.check_config(cfg)

    def act_quant(self) -> ActQuant | None:
        """The quantisation prepare applies to the activations for these experts."""
        return self.cfg.quant.spec.act_quant if self.takes_quantized_input else None

    def wire_quant(self) -> ActQuant | None:
        """The quantisation an expert-parallel dispatch may apply before it moves the rows:
        act_quant's, or, for experts that quantise their own input but take it quantised too,
        the one they would apply (the same bits either way)."""
        return self.act_quant()

    def workspace_shapes(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:  # noqa: ARG002
        """Named buffers apply() takes from the workspace for a chunk of `num_tokens` tokens."""
        return {}

    def by_tokens(self) -> tuple[tuple[int, str], ...]:
        """Which backend runs a call, by token count: (from this many tokens, backend name),
        ascending (`/backends`). One step, unless the stage switches by token count."""
        return ((1, self.name),)

    @abstractmethod
    def apply(self, x: Dispatched, ws: Workspace, into: SumTarget | None = None) -> torch.Tensor:
        """STANDARD: [M, K] if reduces_topk else [M, k, K] (zero rows for ids of -1).
        BATCHED: [E_local, max_tokens, K] (padding rows unspecified).
        `into` (reduces_topk only): write the sum there (+ its extra) and return `into.out`;
        None: a buffer of the experts' own (float32 where the experts sum in their own pass)."""


class PrepareFinalize(ABC):
    name: ClassVar[str]
    format: ClassVar[Format]
    graph_capturable: ClassVar[bool] = False  # as Experts.graph_capturable, for both ends
    max_capture_tokens: ClassVar[int | None] = None  # capturable up to this many tokens; None: any

    @classmethod
    def supports(cls, device: torch.device) -> Support:  # noqa: ARG003
        return YES

    def planned_tokens(self, hidden: torch.Tensor) -> int:
        """How many tokens the kernel plans its chunks for, given this rank's hidden [M, K].

        A stage whose prepare and finalize are collectives answers the same on every rank, so
        that every rank runs as many chunks (ranks may bring different M, 0 included)."""
        return hidden.shape[0]

    @abstractmethod
    def prepare(
        self, hidden: torch.Tensor, routing: Routing, spec: DispatchSpec, ws: Workspace
    ) -> Dispatched:
        """hidden [M, K] + global routing -> what the experts take, in this stage's format."""

    def sum_target(
        self,
        x: Dispatched,  # noqa: ARG002
        out: torch.Tensor,
        extra: SideOutput | None,
        ws: Workspace,  # noqa: ARG002
        spec: DispatchSpec,  # noqa: ARG002
    ) -> SumTarget:
        """Where experts that reduce top-k write the sum for `x` (prepare's), given the chunk's
        output rows `out` and the shared experts' output `extra`; extra left out of the target
        is finalize's to add. Default: straight into out, extra included (nothing moves)."""
        return SumTarget(out, extra)

    def finalize(
        self,
        expert_out: torch.Tensor,
        x: Dispatched,
        out: torch.Tensor,
        reduce: bool,
        extra: SideOutput | None = None,
    ) -> None:
        """Write the layer output [M, K] into `out`; weigh and sum over top-k when `reduce`;
        add `extra` (float32 [M, K] of this rank's own rows) before rounding to out's dtype."""
        if extra is not None:  # joined first: combine may end a captured phase, which CUDA
            extra = SideOutput(extra.wait())  # allows only once the capture's forks have joined
        summed = self.combine(expert_out, x, reduce)
        if isinstance(summed, torch.Tensor):
            summed = summed[: out.shape[0]]
        if summed is not None:
            SumTarget(out, extra).write(summed)

    @abstractmethod
    def combine(
        self, expert_out: torch.Tensor | ColumnBlocks, x: Dispatched, reduce: bool
    ) -> torch.Tensor | ColumnBlocks | None:
        """The experts' output -> this rank's rows of the routed sum [>= M, K] (weighed and
        summed over top-k when `reduce`), or None where none of the output lands on this rank.
        Column blocks (a sum target's, sum_target) come back as blocks of exactly M rows."""


def weighted_topk_sum(
    expert_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """TopKWeightAndReduce for the standard format: [M, k, K] -> float32 [M, K].

    Slots whose expert is not local (-1) contribute nothing, whatever their rows hold.
    """
    w = torch.where(topk_ids >= 0, topk_weights, 0.0).float()
    rows = torch.where((topk_ids >= 0)[..., None], expert_out.float(), 0.0)
    return torch.einsum("mk,mkh->mh", w, rows)
