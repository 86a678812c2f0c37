"""Per family: a tiny checkpoint in its exact on-disk layout -> convert -> load -> the reference
backend's forward equals a plain per-expert loop over the checkpoint's original tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.weights.convert.pipeline import convert_checkpoint
from moe_serve.weights.load import load_layer
from tests.weights import tiny_hub
from tests.weights.tiny_hub import Expert, Hub, moe_loop, run_expert, silu, softmax_topk

CPU = torch.device("cpu")


@dataclass
class Case:
    """A family's tiny checkpoint and its original math."""

    hub: Hub
    experts: list[Expert]
    choose: Callable[[torch.Tensor], list[tuple[int, float]]]
    act: Callable = silu
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None
    tol: float = 1e-5  # float32 layers: only summation order differs

    def expected(self, x: torch.Tensor) -> torch.Tensor:
        out = moe_loop(x.double(), self.experts, self.choose, self.act)
        if self.shared is not None:
            out += torch.stack([self.shared(token) for token in x.double()])
        return out


def _gated(hub: Hub, template: str, names: tuple[str, str, str], count: int) -> list[Expert]:
    return [Expert(*(hub.t(template.format(e=e, proj=n)) for n in names)) for e in range(count)]


def mixtral_case(root: Path) -> Case:
    hub = tiny_hub.mixtral(root)
    experts = _gated(hub, "block_sparse_moe.experts.{e}.{proj}.weight", ("w1", "w3", "w2"), 4)
    gate = hub.t("block_sparse_moe.gate.weight")
    return Case(hub, experts, lambda x: softmax_topk(gate @ x, 2, renormalize=True))


def qwen_case(root: Path, model_type: str) -> Case:
    hub = tiny_hub.qwen_moe(root, model_type)
    projections = ("gate_proj", "up_proj", "down_proj")
    experts = _gated(hub, "mlp.experts.{e}.{proj}.weight", projections, 4)
    gate = hub.t("mlp.gate.weight")
    qwen2 = model_type == "qwen2_moe"
    case = Case(hub, experts, lambda x: softmax_topk(gate @ x, 2, renormalize=not qwen2))
    if qwen2:
        shared = Expert(*(hub.t(f"mlp.shared_expert.{n}.weight") for n in projections))
        shared_gate = hub.t("mlp.shared_expert_gate.weight")[0]
        case.shared = lambda x: run_expert(x, shared, silu) * torch.sigmoid(shared_gate @ x)
        case.tol = 1e-2  # bf16 layer: the output is rounded to bf16
    return case


def deepseek_v3_case(root: Path, intermediate: int = 128) -> Case:
    hub = tiny_hub.deepseek_v3_fp8(root, intermediate=intermediate)
    projections = ("gate_proj", "up_proj", "down_proj")
    experts = _gated(hub, "mlp.experts.{e}.{proj}.weight", projections, 8)
    gate, bias = hub.t("mlp.gate.weight"), hub.t("mlp.gate.e_score_correction_bias")

    def choose(x: torch.Tensor) -> list[tuple[int, float]]:
        scores = torch.sigmoid(gate @ x)
        choice = (scores + bias).view(4, 2)  # 4 groups of 2
        best_groups = torch.topk(choice.topk(2).values.sum(-1), 2).indices
        masked = torch.full_like(choice, -torch.inf)
        masked[best_groups] = choice[best_groups]
        top = torch.topk(masked.flatten(), 2).indices.tolist()
        total = sum(float(scores[e]) for e in top)
        return [(e, 2.5 * float(scores[e]) / total) for e in top]

    shared = Expert(*(hub.t(f"mlp.shared_experts.{n}.weight") for n in projections))
    # fp8-block quantises the activations (1 x 128 groups) before each GEMM: a few % error
    return Case(hub, experts, choose, shared=lambda x: run_expert(x, shared, silu), tol=0.06)


def deepseek_v2_case(root: Path) -> Case:
    hub = tiny_hub.deepseek_v2(root)
    projections = ("gate_proj", "up_proj", "down_proj")
    experts = _gated(hub, "mlp.experts.{e}.{proj}.weight", projections, 8)
    gate = hub.t("mlp.gate.weight")

    def choose(x: torch.Tensor) -> list[tuple[int, float]]:
        scores = torch.softmax(gate @ x, 0)
        group = int(scores.view(2, 4).amax(-1).argmax())  # 1 of 2 groups, by its best expert
        top = (group * 4 + torch.topk(scores.view(2, 4)[group], 3).indices).tolist()
        return [(e, 16.0 * float(scores[e])) for e in top]

    return Case(hub, experts, choose)


def gpt_oss_case(root: Path, mxfp4: bool) -> Case:
    hub = tiny_hub.gpt_oss(root, mxfp4)
    if mxfp4:
        gate_up = tiny_hub.dequant_mxfp4(
            hub.tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"],
            hub.tensors["model.layers.0.mlp.experts.gate_up_proj_scales"],
        )  # [E, 2I, H]
        down = tiny_hub.dequant_mxfp4(
            hub.tensors["model.layers.0.mlp.experts.down_proj_blocks"],
            hub.tensors["model.layers.0.mlp.experts.down_proj_scales"],
        )  # [E, H, I]
    else:
        gate_up = hub.t("mlp.experts.gate_up_proj").transpose(1, 2)  # [E, H, 2I] on disk
        down = hub.t("mlp.experts.down_proj").transpose(1, 2)  # [E, I, H] on disk
    b13, b2 = hub.t("mlp.experts.gate_up_proj_bias"), hub.t("mlp.experts.down_proj_bias")
    experts = [  # gate and up interleave along 2I
        Expert(gate_up[e, 0::2], gate_up[e, 1::2], down[e], b13[e, 0::2], b13[e, 1::2], b2[e])
        for e in range(4)
    ]
    weight, bias = hub.t("mlp.router.weight"), hub.t("mlp.router.bias")

    def choose(x: torch.Tensor) -> list[tuple[int, float]]:
        logits = weight @ x + bias
        top = torch.topk(logits, 2).indices
        return list(zip(top.tolist(), torch.softmax(logits[top], 0).tolist(), strict=True))

    return Case(hub, experts, choose, act=tiny_hub.swiglu_oai(5.0))


CASES: dict[str, Callable[[Path], Case]] = {
    "mixtral-sharded": mixtral_case,
    "qwen2_moe-bf16-shared": lambda root: qwen_case(root, "qwen2_moe"),
    "qwen3_moe": lambda root: qwen_case(root, "qwen3_moe"),
    "deepseek_v3-fp8": deepseek_v3_case,
    "deepseek_v3-fp8-partial-blocks": lambda root: deepseek_v3_case(root, intermediate=328),
    "deepseek_v2-grouped": deepseek_v2_case,
    "gpt_oss-mxfp4": lambda root: gpt_oss_case(root, mxfp4=True),
    "gpt_oss-bf16-layout": lambda root: gpt_oss_case(root, mxfp4=False),
}


def forward(layer_dir: Path, x: torch.Tensor) -> torch.Tensor:
    loaded = load_layer(layer_dir, CPU)
    layer, _ = build_layer(loaded.config, loaded.weights, CPU)
    return layer.forward(ForwardInputs(x.to(loaded.config.dtype))).output


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("tokens", [1, 9], ids=["M1", "M9"])
def test_converted_layer_matches_a_loop_over_the_original_tensors(
    family: str, tokens: int, tmp_path: Path
):
    case = CASES[family](tmp_path / "hub")
    convert_checkpoint(case.hub.root, case.hub.layer, tmp_path / "out")
    h = case.experts[0].gate.shape[1]
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(tokens))
    if case.hub.config["torch_dtype"] == "bfloat16":
        x = x.to(torch.bfloat16)
    err = relative_error(forward(tmp_path / "out", x), case.expected(x))
    assert err < case.tol, f"{family}: relative error {err:.3g}"


@pytest.mark.parametrize("intermediate", [128, 328])  # 328: partial last blocks (H is 200)
def test_deepseek_fp8_experts_are_kept_bit_for_bit(tmp_path: Path, intermediate: int):
    hub = tiny_hub.deepseek_v3_fp8(tmp_path / "hub", intermediate=intermediate)
    manifest = convert_checkpoint(hub.root, 1, tmp_path / "out")
    assert manifest.config.quant.scheme == "fp8-block"
    experts = load_layer(tmp_path / "out", CPU).weights.experts
    p = "model.layers.1.mlp.experts.5"
    gate_up = torch.cat([hub.tensors[f"{p}.gate_proj.weight"], hub.tensors[f"{p}.up_proj.weight"]])
    assert torch.equal(experts.w13[5].view(torch.uint8), gate_up.view(torch.uint8))
    assert torch.equal(
        experts.w13_scale[5],
        torch.cat(
            [
                hub.tensors[f"{p}.gate_proj.weight_scale_inv"],
                hub.tensors[f"{p}.up_proj.weight_scale_inv"],
            ]
        ),
    )
    assert torch.equal(experts.w2_scale[5], hub.tensors[f"{p}.down_proj.weight_scale_inv"])


def test_fp8_partial_blocks_requantise_exactly_from_each_projections_own_scales(tmp_path: Path):
    hub = tiny_hub.deepseek_v3_fp8(tmp_path / "hub", intermediate=328)
    convert_checkpoint(hub.root, 1, tmp_path / "out", quant=QuantConfig(QuantScheme.NONE))
    experts = load_layer(tmp_path / "out", CPU).weights.experts
    p = "mlp.experts.3"
    gate_up = torch.cat([hub.t(f"{p}.gate_proj.weight"), hub.t(f"{p}.up_proj.weight")])
    bf16 = {"rtol": 2.0**-8, "atol": 0.0}  # one rounding to the layer's bf16
    torch.testing.assert_close(experts.w13[3].double(), gate_up, **bf16)
    torch.testing.assert_close(experts.w2[3].double(), hub.t(f"{p}.down_proj.weight"), **bf16)


def test_gpt_oss_mxfp4_blocks_are_kept_bit_for_bit(tmp_path: Path):
    hub = tiny_hub.gpt_oss(tmp_path / "hub", mxfp4=True)
    convert_checkpoint(hub.root, 0, tmp_path / "out")
    experts = load_layer(tmp_path / "out", CPU).weights.experts
    p = "model.layers.0.mlp.experts"
    assert torch.equal(experts.w13, hub.tensors[f"{p}.gate_up_proj_blocks"].flatten(-2))
    assert torch.equal(experts.w2_scale, hub.tensors[f"{p}.down_proj_scales"])


def test_manifest_records_family_layer_and_routing(tmp_path: Path):
    hub = tiny_hub.deepseek_v3_fp8(tmp_path / "hub")
    m = convert_checkpoint(hub.root, 1, tmp_path / "out", name="dsv3.l1")
    assert (m.name, m.source.family, m.source.model, m.source.layer) == (
        "dsv3.l1",
        "deepseek_v3",
        "hub",
        1,
    )
    r = m.config.routing
    assert (r.scoring, r.num_groups, r.topk_groups, r.group_score) == ("sigmoid", 4, 2, "top2_sum")
    assert (r.routed_scaling_factor, m.correction_bias, m.shared_intermediate_size) == (
        2.5,
        True,
        128,
    )
