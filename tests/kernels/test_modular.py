"""Composition rules of the modular kernel, its workspaces, and the backend registry."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

from moe_serve.kernels import registry, selection
from moe_serve.kernels.config import ActivationSpec, MoEConfig, RoutingConfig
from moe_serve.kernels.experts.reference import BatchedReferenceExperts, ReferenceExperts
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.prepare_finalize.batched import Batched
from moe_serve.kernels.prepare_finalize.no_ep import NoEP
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.routing import route
from moe_serve.kernels.stages import Experts, SideOutput, Support
from moe_serve.kernels.tensors import Format
from moe_serve.kernels.workspace import Workspace


class _CountingExperts(ReferenceExperts):
    """The reference, asking for a workspace buffer like a real backend does."""

    name: ClassVar[str] = "counting"

    def workspace_shapes(self, num_tokens: int) -> dict:
        return {
            "intermediate": (
                (num_tokens * self.cfg.top_k, 2 * self.cfg.intermediate_size),
                torch.float32,
            )
        }

    def apply(self, x, ws):
        buf = ws.get(
            "intermediate",
            (x.num_tokens * self.cfg.top_k, 2 * self.cfg.intermediate_size),
            torch.float32,
        )
        self.seen = buf.data_ptr()
        return super().apply(x, ws)


def test_second_call_of_same_or_smaller_size_allocates_nothing(tiny_config: MoEConfig) -> None:
    ws = Workspace("cpu")
    kernel = ModularKernel(
        NoEP(),
        _CountingExperts(tiny_config, random_expert_weights(tiny_config)),
        ws,
        chunk_tokens=64,
    )
    assert ws.allocations == 1  # reserved at construction for 64 tokens
    for m in (64, 64, 3, 1):
        kernel.forward(torch.randn(m, 64), route(torch.randn(m, 4), tiny_config.routing))
    assert ws.allocations == 1
    kernel.forward(
        torch.randn(200, 64), route(torch.randn(200, 4), tiny_config.routing)
    )  # chunked by 64
    assert ws.allocations == 1


def test_layers_sharing_a_workspace_share_its_buffers(tiny_config: MoEConfig) -> None:
    ws = Workspace("cpu")
    a = _CountingExperts(tiny_config, random_expert_weights(tiny_config, 1))
    b = _CountingExperts(tiny_config, random_expert_weights(tiny_config, 2))
    ka, kb = (
        ModularKernel(NoEP(), a, ws, chunk_tokens=32),
        ModularKernel(NoEP(), b, ws, chunk_tokens=32),
    )
    for kernel in (ka, kb):
        kernel.forward(torch.randn(8, 64), route(torch.randn(8, 4), tiny_config.routing))
    assert a.seen == b.seen and ws.allocations == 1


def test_workspace_grows_once_for_a_larger_request() -> None:
    ws = Workspace("cpu")
    small = ws.get("x", (4, 4), torch.float32)
    assert small.shape == (4, 4) and ws.allocations == 1
    ws.get("x", (8, 8), torch.float16)
    ws.get("x", (2, 2), torch.float32)
    assert ws.allocations == 2 and ws.nbytes == 128


def test_formats_must_agree(tiny_config: MoEConfig) -> None:
    with pytest.raises(ValueError, match="batched"):
        ModularKernel(
            Batched(),
            ReferenceExperts(tiny_config, random_expert_weights(tiny_config)),
            Workspace("cpu"),
        )
    with pytest.raises(ValueError, match="standard"):
        ModularKernel(
            NoEP(),
            BatchedReferenceExperts(tiny_config, random_expert_weights(tiny_config)),
            Workspace("cpu"),
        )


def test_duplicate_backend_names_are_refused() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        registry.by_name(
            ReferenceExperts, type("Again", (ReferenceExperts,), {"name": "reference"})
        )


def test_registry_lists_every_builtin_backend() -> None:
    assert {"reference", "reference-batched"} <= set(registry.experts_backends())
    assert {"no-ep", "batched"} <= set(registry.prepare_finalize_backends())


def test_select_forced_backend_reports_why_it_cannot_run(tiny_config: MoEConfig) -> None:
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        selection.select(tiny_config, torch.device("cpu"), "nope")


def test_auto_on_cpu_picks_the_reference_with_no_ep(tiny_config: MoEConfig) -> None:
    choice = selection.select(tiny_config, torch.device("cpu"))
    assert choice.experts is ReferenceExperts and choice.prepare_finalize is NoEP
    assert "auto" in choice.reason


def test_supports_names_scheme_activation_and_device() -> None:
    class Fp8Only(Experts):
        name: ClassVar[str] = "fp8-only"
        format: ClassVar[Format] = Format.STANDARD
        schemes: ClassVar[frozenset] = frozenset({QuantScheme.FP8_BLOCK})
        activations: ClassVar[frozenset] = frozenset({"silu"})

        def apply(self, x, ws):
            raise AssertionError

    cfg = MoEConfig(
        num_experts=4, hidden_size=64, intermediate_size=64, routing=RoutingConfig(top_k=2)
    )
    assert Fp8Only.supports(cfg, torch.device("cpu")) == Support(False, "runs on cuda, not cpu")
    cuda = torch.device("cuda")
    assert "quant scheme none" in Fp8Only.supports(cfg, cuda).reason
    gelu = MoEConfig(
        num_experts=4,
        hidden_size=64,
        intermediate_size=64,
        routing=RoutingConfig(top_k=2),
        quant=QuantConfig(QuantScheme.FP8_BLOCK),
        activation=ActivationSpec("gelu"),
    )
    assert "activation gelu" in Fp8Only.supports(gelu, cuda).reason


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_experts": 0}, "num_experts"),
        ({"routing": RoutingConfig(top_k=9)}, "exceeds num_experts"),
        ({"routing": RoutingConfig(top_k=2, num_groups=3)}, "divisible"),
        ({"quant": QuantConfig(QuantScheme.MXFP4), "hidden_size": 48}, "multiple of 32"),
        ({"dtype": torch.int8}, "dtype"),
        ({"apply_router_weight_on_input": True}, "top_k == 1"),
    ],
)
def test_bad_layer_config_is_refused(kwargs: dict, message: str) -> None:
    base = {
        "num_experts": 8,
        "hidden_size": 64,
        "intermediate_size": 64,
        "routing": RoutingConfig(top_k=2),
    }
    with pytest.raises(ValueError, match=message):
        MoEConfig(**(base | kwargs))


def test_unknown_quant_scheme_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="fp8-block"):
        QuantConfig("fp4")


class _OrderedNoEP(NoEP):
    """NoEP recording when its prepare runs."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def prepare(self, hidden, routing, spec, ws):
        self.events.append("prepare")
        return super().prepare(hidden, routing, spec, ws)


@pytest.mark.parametrize("m", [1, 7, 150])  # 150: three chunks of 64
def test_shared_experts_queued_once_after_the_first_prepare_join_the_sum_before_its_rounding(
    tiny_config: MoEConfig, m: int
) -> None:
    """Queued after the first prepare (naive-ep's broadcast: kernels/modular.py), once for all
    the rows; their float32 output is added to the routed float32 sum, each chunk's to its own
    rows, and the sum rounds once."""
    cfg = dataclasses.replace(tiny_config, dtype=torch.bfloat16)
    events: list[str] = []
    experts = ReferenceExperts(cfg, random_expert_weights(cfg))
    kernel = ModularKernel(_OrderedNoEP(events), experts, Workspace("cpu"), chunk_tokens=64)
    hidden = torch.randn(m, 64).bfloat16()
    routing = route(torch.randn(m, 4), cfg.routing)
    extra = torch.randn(m, 64)

    def shared() -> SideOutput:
        events.append("shared")
        return SideOutput(extra)

    out = kernel.forward(hidden, routing, shared=shared)
    assert events == ["prepare", "shared"] + ["prepare"] * (-(-m // 64) - 1)
    routed = kernel.forward(hidden, routing, out=torch.empty(m, 64))  # float32: not rounded
    assert torch.equal(out, (routed + extra).bfloat16())
