"""Tiny Hugging Face checkpoints, written in each family's exact on-disk layout, and a plain
float64 per-token, per-expert loop over their *original* tensors to check conversions against.

Each builder writes config.json and safetensors under a directory and returns a `Hub` holding
the tensors it wrote, so a test can damage the checkpoint or compute the expected output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_serve.kernels.arith import ceil_div
from moe_serve.kernels.quant_scheme import FP8


@dataclass
class Hub:
    root: Path
    config: dict
    tensors: dict[str, torch.Tensor]  # everything written, by name
    layer: int  # the MoE layer the tests convert
    shards: dict[str, list[str]] = field(default_factory=dict)  # file -> names; one file if empty

    def write(self) -> Hub:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "config.json").write_text(json.dumps(self.config))
        if not self.shards:
            save_file(self.tensors, self.root / "model.safetensors")
            return self
        weight_map = {}
        for file, names in self.shards.items():
            save_file({n: self.tensors[n] for n in names}, self.root / file)
            weight_map |= dict.fromkeys(names, file)
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (self.root / "model.safetensors.index.json").write_text(json.dumps(index))
        return self

    def t(self, suffix: str) -> torch.Tensor:
        """An original tensor of the MoE layer, as float64 (fp8 ones dequantised exactly)."""
        name = f"model.layers.{self.layer}.{suffix}"
        t = self.tensors[name]
        if t.dtype != FP8:
            return t.double()
        scale = self.tensors[f"{name}_scale_inv"].double()
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return t.double() * full[: t.shape[0], : t.shape[1]]


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _dense_attention(layer: int, h: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A tensor every real checkpoint has beside the MoE: the converter must leave it alone."""
    return {f"model.layers.{layer}.self_attn.q_proj.weight": _randn(gen, h, h)}


def mixtral(root: Path, seed: int = 0) -> Hub:
    """E=4, H=64, I=96, top_k=2, float32, two layers in two shards with an index file."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i = 4, 64, 96
    config = {
        "model_type": "mixtral",
        "num_hidden_layers": 2,
        "num_local_experts": e,
        "num_experts_per_tok": 2,
        "hidden_size": h,
        "intermediate_size": i,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    tensors, shards = {}, {}
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe"
        part = {f"{p}.gate.weight": _randn(gen, e, h)} | _dense_attention(layer, h, gen)
        for x in range(e):
            part[f"{p}.experts.{x}.w1.weight"] = _randn(gen, i, h, scale=h**-0.5)
            part[f"{p}.experts.{x}.w3.weight"] = _randn(gen, i, h, scale=h**-0.5)
            part[f"{p}.experts.{x}.w2.weight"] = _randn(gen, h, i, scale=i**-0.5)
        tensors |= part
        shards[f"model-0000{layer + 1}-of-00002.safetensors"] = list(part)
    return Hub(root, config, tensors, layer=1, shards=shards).write()


def qwen_moe(root: Path, model_type: str, seed: int = 0) -> Hub:
    """E=4, H=64, I=32; layer 0 dense (mlp_only_layers), layer 1 MoE.

    qwen2_moe: bf16 on disk, a shared expert (I_s=48) with its sigmoid gate, no renormalising.
    qwen3_moe: float32, no shared expert, norm_topk_prob.
    """
    gen = torch.Generator().manual_seed(seed)
    e, h, i, si = 4, 64, 32, 48
    qwen2 = model_type == "qwen2_moe"
    dtype = torch.bfloat16 if qwen2 else torch.float32
    config = {
        "model_type": model_type,
        "num_hidden_layers": 2,
        "num_experts": e,
        "num_experts_per_tok": 2,
        "hidden_size": h,
        "moe_intermediate_size": i,
        "norm_topk_prob": not qwen2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "torch_dtype": "bfloat16" if qwen2 else "float32",
    }
    p = "model.layers.1.mlp"
    tensors = {f"{p}.gate.weight": _randn(gen, e, h)} | _dense_attention(1, h, gen)
    tensors["model.layers.0.mlp.gate_proj.weight"] = _randn(gen, 128, h)  # the dense layer
    for x in range(e):
        tensors[f"{p}.experts.{x}.gate_proj.weight"] = _randn(gen, i, h, scale=h**-0.5)
        tensors[f"{p}.experts.{x}.up_proj.weight"] = _randn(gen, i, h, scale=h**-0.5)
        tensors[f"{p}.experts.{x}.down_proj.weight"] = _randn(gen, h, i, scale=i**-0.5)
    if qwen2:
        config["shared_expert_intermediate_size"] = si
        tensors[f"{p}.shared_expert.gate_proj.weight"] = _randn(gen, si, h, scale=h**-0.5)
        tensors[f"{p}.shared_expert.up_proj.weight"] = _randn(gen, si, h, scale=h**-0.5)
        tensors[f"{p}.shared_expert.down_proj.weight"] = _randn(gen, h, si, scale=si**-0.5)
        tensors[f"{p}.shared_expert_gate.weight"] = _randn(gen, 1, h, scale=h**-0.5)
    tensors = {n: t.to(dtype) for n, t in tensors.items()}
    return Hub(root, config, tensors, layer=1).write()


def _fp8_linear(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp8 values and positive 128 x 128 block multipliers, as DeepSeek-V3 ships them."""
    w = _randn(gen, n, k, scale=100.0).clamp(-448, 448).to(FP8)
    scale = (torch.rand(ceil_div(n, 128), ceil_div(k, 128), generator=gen) + 0.5) * 1e-3
    return w, scale


def deepseek_v3_fp8(root: Path, seed: int = 0, intermediate: int = 128) -> Hub:
    """E=8 in 4 groups (2 chosen), top_k=2, H=200 (not a block multiple), I=128 (or
    `intermediate`: 328 gives gate, up and down partial last blocks), one shared expert, sigmoid
    + correction bias, scaled by 2.5; fp8 with weight_scale_inv; layer 0 dense."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i = 8, 200, intermediate
    config = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 2,
        "n_routed_experts": e,
        "num_experts_per_tok": 2,
        "hidden_size": h,
        "moe_intermediate_size": i,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    }
    p = "model.layers.1.mlp"
    tensors = {
        f"{p}.gate.weight": _randn(gen, e, h).to(torch.bfloat16),
        f"{p}.gate.e_score_correction_bias": _randn(gen, e, scale=0.1),
    }
    shapes = (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))
    for owner in [*(f"experts.{x}" for x in range(e)), "shared_experts"]:
        for proj, (n, k) in shapes:
            w, s = _fp8_linear(gen, n, k)
            tensors[f"{p}.{owner}.{proj}.weight"] = w
            tensors[f"{p}.{owner}.{proj}.weight_scale_inv"] = s
    return Hub(root, config, tensors, layer=1).write()


def deepseek_v2(root: Path, seed: int = 0) -> Hub:
    """float32, E=8 in 2 groups (1 chosen, by its best expert), top_k=3, softmax, no
    renormalising, scaled by 16 (DeepSeek-V2's routed_scaling_factor); no shared expert."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i = 8, 64, 48
    config = {
        "model_type": "deepseek_v2",
        "num_hidden_layers": 1,
        "n_routed_experts": e,
        "num_experts_per_tok": 3,
        "hidden_size": h,
        "moe_intermediate_size": i,
        "n_shared_experts": None,
        "first_k_dense_replace": 0,
        "scoring_func": "softmax",
        "topk_method": "group_limited_greedy",
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 16.0,
        "torch_dtype": "float32",
    }
    p = "model.layers.0.mlp"
    tensors = {f"{p}.gate.weight": _randn(gen, e, h)}
    for x in range(e):
        tensors[f"{p}.experts.{x}.gate_proj.weight"] = _randn(gen, i, h, scale=h**-0.5)
        tensors[f"{p}.experts.{x}.up_proj.weight"] = _randn(gen, i, h, scale=h**-0.5)
        tensors[f"{p}.experts.{x}.down_proj.weight"] = _randn(gen, h, i, scale=i**-0.5)
    return Hub(root, config, tensors, layer=0).write()


def gpt_oss(root: Path, mxfp4: bool, seed: int = 0) -> Hub:
    """E=4, top_k=2, H=64, I=64, float32 besides the MXFP4 blocks; swiglu_limit 5."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i = 4, 64, 64
    config = {
        "model_type": "gpt_oss",
        "num_hidden_layers": 1,
        "num_local_experts": e,
        "num_experts_per_tok": 2,
        "hidden_size": h,
        "intermediate_size": i,
        "swiglu_limit": 5.0,
        "torch_dtype": "float32",
    }
    p = "model.layers.0.mlp"
    tensors = {
        f"{p}.router.weight": _randn(gen, e, h),
        f"{p}.router.bias": _randn(gen, e),
        f"{p}.experts.gate_up_proj_bias": _randn(gen, e, 2 * i, scale=0.1),
        f"{p}.experts.down_proj_bias": _randn(gen, e, h, scale=0.1),
    }
    if mxfp4:
        config["quantization_config"] = {"quant_method": "mxfp4"}
        for name, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(119, 125, (e, n, k // 32), generator=gen, dtype=torch.uint8)
            tensors[f"{p}.experts.{name}_blocks"] = blocks
            tensors[f"{p}.experts.{name}_scales"] = scales
    else:
        tensors[f"{p}.experts.gate_up_proj"] = _randn(gen, e, h, 2 * i, scale=h**-0.5)
        tensors[f"{p}.experts.down_proj"] = _randn(gen, e, i, h, scale=i**-0.5)
    return Hub(root, config, tensors, layer=0).write()


# ---- the expected output: one token, one expert at a time, float64 -----------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, N, G, 16] uint8 (low nibble first) + [E, N, G] e8m0 -> [E, N, G * 32] float64."""
    lut = torch.tensor(E2M1, dtype=torch.float64)
    values = torch.stack([lut[(blocks & 0xF).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [E, N, G, 32]
    return (values * torch.exp2(scales.double() - 127)[..., None]).flatten(-2)


@dataclass
class Expert:
    """One expert's original math: float64, [N, K] weights."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | float = 0.0
    up_bias: torch.Tensor | float = 0.0
    down_bias: torch.Tensor | float = 0.0


def silu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return g / (1 + torch.exp(-g)) * u


def swiglu_oai(limit: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return (u + 1) * g * torch.sigmoid(1.702 * g)

    return act


def run_expert(x: torch.Tensor, ex: Expert, act: Callable) -> torch.Tensor:
    h = act(ex.gate @ x + ex.gate_bias, ex.up @ x + ex.up_bias)
    return ex.down @ h + ex.down_bias


def moe_loop(
    x: torch.Tensor,
    experts: list[Expert],
    choose: Callable[[torch.Tensor], list[tuple[int, float]]],
    act: Callable,
) -> torch.Tensor:
    """x [M, H] float64 -> [M, H]: for each token, sum of weight * expert(x) over its choices."""
    rows = []
    for token in x:
        out = torch.zeros_like(token)
        for e, w in choose(token):
            out += w * run_expert(token, experts[e], act)
        rows.append(out)
    return torch.stack(rows)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> list[tuple[int, float]]:
    probs = torch.softmax(logits, dim=0)
    top = torch.topk(probs, k).indices.tolist()
    total = sum(float(probs[e]) for e in top) if renormalize else 1.0
    return [(e, float(probs[e]) / total) for e in top]
