"""Bad checkpoints and options: each a clear message naming the file and tensor, nothing written.
And the round trip through every --quant scheme, within the scheme's error bound."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.service.cli import main
from moe_serve.weights.convert.pipeline import convert_checkpoint, default_name
from moe_serve.weights.errors import LayerFileError
from moe_serve.weights.load import load_layer
from tests.weights import tiny_hub
from tests.weights.test_convert import forward, mixtral_case


def _edit_config(hub: tiny_hub.Hub, **changes: object) -> None:
    hub.config.update(changes)
    hub.write()


def _convert_fails(hub: tiny_hub.Hub, layer: int, out: Path, match: str) -> None:
    """Converting must raise `match` and leave nothing at or beside `out`."""
    before = sorted(out.parent.iterdir())
    with pytest.raises(ValueError, match=match):
        convert_checkpoint(hub.root, layer, out)
    assert sorted(out.parent.iterdir()) == before


@pytest.fixture
def mixtral(tmp_path: Path) -> tiny_hub.Hub:
    return tiny_hub.mixtral(tmp_path / "hub")


def test_unknown_model_type_lists_the_supported_ones(mixtral: tiny_hub.Hub, tmp_path: Path):
    _edit_config(mixtral, model_type="llama")
    _convert_fails(
        mixtral,
        1,
        tmp_path / "out",
        r"config\.json: model_type 'llama' is not "
        r"supported; expected one of mixtral, qwen2_moe",
    )


def test_missing_config_is_named(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(LayerFileError, match=r"empty/config\.json: missing"):
        convert_checkpoint(tmp_path / "empty", 0, tmp_path / "out")


def test_layer_out_of_range(mixtral: tiny_hub.Hub, tmp_path: Path):
    _convert_fails(
        mixtral, 2, tmp_path / "out", r"config\.json: layer 2 is out of range: num_hidden_layers"
    )


def test_missing_expert_tensor_names_the_index_and_tensor(mixtral: tiny_hub.Hub, tmp_path: Path):
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    del mixtral.tensors[name]
    mixtral.shards["model-00002-of-00002.safetensors"].remove(name)
    mixtral.write()
    _convert_fails(
        mixtral,
        1,
        tmp_path / "out",
        re.escape(f"model.safetensors.index.json: tensor '{name}': missing from the checkpoint"),
    )


def test_missing_shard_names_the_shard(mixtral: tiny_hub.Hub, tmp_path: Path):
    (mixtral.root / "model-00002-of-00002.safetensors").unlink()
    _convert_fails(
        mixtral,
        1,
        tmp_path / "out",
        r"model-00002-of-00002\.safetensors: tensor 'model\.layers\.1\..*': shard missing",
    )


def test_only_layer_n_is_read(mixtral: tiny_hub.Hub, tmp_path: Path):
    (mixtral.root / "model-00001-of-00002.safetensors").write_bytes(b"not read")
    assert convert_checkpoint(mixtral.root, 1, tmp_path / "out").source.layer == 1


def test_shape_contradicting_config_names_file_and_tensor(mixtral: tiny_hub.Hub, tmp_path: Path):
    _edit_config(mixtral, intermediate_size=80)
    _convert_fails(
        mixtral,
        1,
        tmp_path / "out",
        r"model-00002-of-00002\.safetensors: tensor 'model\.layers\.1\.block_sparse_moe\.experts"
        r"\.0\.w1\.weight': shape \[96, 64\] contradicts config\.json \(expected \[80, 64\]\)",
    )


def test_top_k_above_experts_is_a_config_error(mixtral: tiny_hub.Hub, tmp_path: Path):
    _edit_config(mixtral, num_experts_per_tok=5)
    _convert_fails(mixtral, 1, tmp_path / "out", r"config\.json: top_k=5 exceeds num_experts=4")


def test_fp8_checkpoint_without_scales(tmp_path: Path):
    hub = tiny_hub.deepseek_v3_fp8(tmp_path / "hub")
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    del hub.tensors[name]
    hub.write()
    _convert_fails(
        hub,
        1,
        tmp_path / "out",
        re.escape(f"model.safetensors: tensor '{name}': fp8 weight without its scale"),
    )


def test_fp8_block_size_other_than_128_is_refused(tmp_path: Path):
    hub = tiny_hub.deepseek_v3_fp8(tmp_path / "hub")
    quant = hub.config["quantization_config"] | {"weight_block_size": [64, 64]}
    _edit_config(hub, quantization_config=quant)
    _convert_fails(hub, 1, tmp_path / "out", r"weight_block_size \[128, 128\], got 'e4m3' and \[64")


@pytest.mark.parametrize(
    ("builder", "message"),
    [
        (lambda root: tiny_hub.qwen_moe(root, "qwen2_moe"), r"mlp_only_layers=\[0\]"),
        (tiny_hub.deepseek_v3_fp8, r"first_k_dense_replace=1"),
    ],
    ids=["qwen2_moe", "deepseek_v3"],
)
def test_dense_layer_is_a_clear_error(builder, message: str, tmp_path: Path):
    hub = builder(tmp_path / "hub")
    _convert_fails(hub, 0, tmp_path / "out", r"layer 0 is a dense MLP layer .*" + message)


def test_unsupported_quantization_method(tmp_path: Path):
    hub = tiny_hub.qwen_moe(tmp_path / "hub", "qwen3_moe")
    _edit_config(hub, quantization_config={"quant_method": "gptq", "bits": 4})
    _convert_fails(hub, 1, tmp_path / "out", r"quant_method 'gptq' is not supported")


def test_quantization_config_that_is_not_an_object(tmp_path: Path):
    hub = tiny_hub.gpt_oss(tmp_path / "hub", mxfp4=True)
    _edit_config(hub, quantization_config="mxfp4")
    _convert_fails(hub, 0, tmp_path / "out", r"config\.json: quantization_config must be an object")


def test_wrong_dtype_names_the_tensor(tmp_path: Path):
    hub = tiny_hub.gpt_oss(tmp_path / "hub", mxfp4=True)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    hub.tensors[name] = hub.tensors[name].float()
    hub.write()
    _convert_fails(hub, 0, tmp_path / "out", re.escape(f"'{name}': dtype torch.float32, expected"))


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_checkpoint_with_a_non_finite_expert_weight_is_refused_naming_it(
    mixtral: tiny_hub.Hub, tmp_path: Path, value: float
):
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    mixtral.tensors[name][5, 9] = value
    mixtral.write()
    _convert_fails(
        mixtral,
        1,
        tmp_path / "out",
        re.escape(f"tensor '{name}': holds NaN or Inf (first at index [5, 9])"),
    )


def test_fp8_checkpoint_with_a_nan_weight_code_is_refused(tmp_path: Path):
    hub = tiny_hub.deepseek_v3_fp8(tmp_path / "hub")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    hub.tensors[name].view(torch.uint8)[0, 1] = 0x7F  # e4m3fn NaN
    hub.write()
    _convert_fails(hub, 1, tmp_path / "out", re.escape(f"'{name}': holds NaN or Inf"))


def test_mxfp4_checkpoint_with_a_nan_scale_code_is_refused(tmp_path: Path):
    hub = tiny_hub.gpt_oss(tmp_path / "hub", mxfp4=True)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    hub.tensors[name][1, 2, 0] = 255  # e8m0 NaN
    hub.write()
    _convert_fails(hub, 0, tmp_path / "out", re.escape(f"'{name}': holds NaN or Inf"))


def test_corrupt_safetensors_file_is_named(tmp_path: Path):
    hub = tiny_hub.qwen_moe(tmp_path / "hub", "qwen3_moe")
    (hub.root / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    _convert_fails(hub, 1, tmp_path / "out", r"model\.safetensors: unreadable safetensors file")


def test_bad_name_is_refused_before_reading(mixtral: tiny_hub.Hub, tmp_path: Path):
    with pytest.raises(ValueError, match=r"layer name 'a/b' must be 1-64 letters"):
        convert_checkpoint(mixtral.root, 1, tmp_path / "out", name="a/b")


def test_quant_that_does_not_fit_the_sizes(mixtral: tiny_hub.Hub, tmp_path: Path):
    with pytest.raises(
        ValueError, match="int4-w4a16 needs intermediate_size to be a multiple of 64"
    ):
        convert_checkpoint(mixtral.root, 1, tmp_path / "out", QuantConfig("int4-w4a16", 64))
    assert not (tmp_path / "out").exists()


def test_cli_convert_reports_file_and_tensor(
    mixtral: tiny_hub.Hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    save_file({"x": torch.zeros(1)}, mixtral.root / "model-00002-of-00002.safetensors")
    code = main(["convert", str(mixtral.root), "--layer", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("moe-serve convert: error: ")
    assert "model-00002-of-00002.safetensors: tensor 'model.layers.1.block_sparse_moe" in err
    assert not (tmp_path / "o").exists()


def test_cli_convert_then_inspect(
    mixtral: tiny_hub.Hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    out = tmp_path / "o"
    argv = [
        "convert",
        str(mixtral.root),
        "--layer",
        "1",
        "--out",
        str(out),
        "--quant",
        "int4-w4a16",
    ]
    assert main([*argv, "--group-size", "32"]) == 0
    assert capsys.readouterr().out == f"{out}: layer 'hub-layer1', int4-w4a16\n"
    assert main(["inspect", str(out)]) == 0
    assert "w13_scale  float32        [4, 192, 2]" in capsys.readouterr().out
    json.loads((out / "manifest.json").read_text())  # plain JSON for other tools


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--quant", "int4-w4a16", "--group-size", "7"], "group_size must be an even number >= 2"),
        (["--quant", "int4-w4a16", "--group-size", "0"], "group_size must be an even number >= 2"),
        (["--quant", "fp8-block", "--group-size", "64"], "--group-size applies to --quant int4"),
        (["--group-size", "64"], "--group-size applies to --quant int4-w4a16 only"),
    ],
)
def test_cli_convert_refuses_a_bad_group_size_with_exit_2_and_a_message(
    mixtral: tiny_hub.Hub, tmp_path: Path, capsys, options: list[str], message: str
):
    argv = ["convert", str(mixtral.root), "--layer", "1", "--out", str(tmp_path / "o")]
    assert main([*argv, *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-serve convert: error: ")
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


# Sends itself SIGTERM once the tensors are in the temp dir, as `kill` would mid-write.
_KILLED_WHILE_WRITING = """
import os, signal, sys, time
import moe_serve.weights.write as write
from moe_serve.service.cli import main
save_file = write.save_file
def save_then_get_killed(*args, **kwargs):
    save_file(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
write.save_file = save_then_get_killed
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_convert_removes_the_temp_dir_and_exits_143(
    mixtral: tiny_hub.Hub, tmp_path: Path
):
    out = tmp_path / "out"
    argv = ["convert", str(mixtral.root), "--layer", "1", "--out", str(out)]
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_WRITING, *argv],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hub"]  # no .out.tmp-* left


def test_convert_removes_temp_dirs_that_a_killed_run_left(mixtral: tiny_hub.Hub, tmp_path: Path):
    out = tmp_path / "out"
    for left in (".out.tmp-k1ll3d", ".out.old-k1ll3d", ".other.tmp-busy"):
        (tmp_path / left).mkdir()
        (tmp_path / left / "experts.safetensors").write_bytes(b"half")
    convert_checkpoint(mixtral.root, 1, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-busy", "hub", "out"]


def test_a_layer_moved_aside_by_a_killed_run_is_restored_not_deleted(
    mixtral: tiny_hub.Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Killed between moving the old layer aside and renaming the new one into place; the next
    run fails while writing: the old layer is back in place."""
    out = tmp_path / "out"
    convert_checkpoint(mixtral.root, 1, out)
    aside = tmp_path / ".out.old-k1ll3d"
    aside.mkdir()
    out.rename(aside / "out")

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("moe_serve.weights.write.save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        convert_checkpoint(mixtral.root, 1, out)
    assert load_layer(out, torch.device("cpu")).name == "hub-layer1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hub", "out"]


# Bound per scheme on a float32 layer: fp8 rounds input, weight and intermediate (3 mantissa
# bits each); int8 only the weight; int4 and mxfp4 keep 1-3 bits of mantissa.
ROUND_TRIP_BOUNDS = {
    QuantScheme.NONE: 1e-5,
    QuantScheme.FP8_TENSOR: 0.1,
    QuantScheme.FP8_TOKEN: 0.1,
    QuantScheme.FP8_BLOCK: 0.1,
    QuantScheme.INT8_W8A16: 0.02,
    QuantScheme.INT4_W4A16: 0.25,
    QuantScheme.MXFP4: 0.3,
}


@pytest.mark.parametrize("scheme", list(QuantScheme), ids=str)
def test_round_trip_through_each_quant_scheme_stays_within_its_bound(
    scheme: QuantScheme, tmp_path: Path
):
    case = mixtral_case(tmp_path / "hub")
    manifest = convert_checkpoint(case.hub.root, 1, tmp_path / "out", QuantConfig(scheme, 32))
    assert manifest.config.quant.scheme == scheme
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(0))
    err = relative_error(forward(tmp_path / "out", x), case.expected(x))
    assert err < ROUND_TRIP_BOUNDS[scheme], f"{scheme}: relative error {err:.3g}"


def test_requantising_fp8_dequantises_exactly_first(tmp_path: Path):
    """fp8-block -> none must give the exact dequantised weights, in the layer dtype."""
    hub = tiny_hub.deepseek_v3_fp8(tmp_path / "hub")
    convert_checkpoint(hub.root, 1, tmp_path / "out", QuantConfig("none"))
    w2 = load_layer(tmp_path / "out", torch.device("cpu")).weights.experts.w2
    assert w2.dtype == torch.bfloat16
    assert torch.equal(w2[3], hub.t("mlp.experts.3.down_proj.weight").to(torch.bfloat16))


@pytest.mark.parametrize(
    ("model_dir", "expected"),
    [
        ("Mixtral-8x7B-v0.1", "Mixtral-8x7B-v0.1-layer3"),
        ("my model (copy)", "my-model-copy-layer3"),
    ],
)
def test_default_name_is_the_model_dir_and_layer_in_url_safe_characters(
    model_dir: str, expected: str, tmp_path: Path
):
    assert default_name(tmp_path / model_dir, 3) == expected
