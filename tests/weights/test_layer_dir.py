"""The layer directory format: atomic write, validated load, expert slices, the demo layers."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.cli import main
from moe_serve.weights.demo import demo_layers, ensure_demo_layers
from moe_serve.weights.errors import LayerFileError
from moe_serve.weights.integrity import checksums
from moe_serve.weights.layout import header_sha256, tensor_offsets
from moe_serve.weights.load import load_layer
from moe_serve.weights.manifest import MANIFEST_FILE, TENSORS_FILE
from moe_serve.weights.write import write_layer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return ensure_demo_layers(tmp_path_factory.mktemp("demo"))


@pytest.fixture
def demo_copy(demo_dirs: list[Path], tmp_path: Path) -> Path:
    """A private copy of the fp8 demo layer that a test may damage."""
    out = tmp_path / "layer"
    out.mkdir()
    for f in demo_dirs[1].iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def _rewrite_manifest(path: Path, **changes: object) -> None:
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest.update(changes)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_demo_layers_are_deterministic_and_fp8_copy_is_close_to_bf16(demo_dirs: list[Path]):
    again = demo_layers()
    for path, (manifest, weights) in zip(demo_dirs, again, strict=True):
        loaded = load_layer(path, CPU)
        assert loaded.manifest.name == manifest.name == path.name
        for name, t in weights.tensors().items():
            assert torch.equal(loaded.weights.tensors()[name], t), name
    bf16, fp8 = (load_layer(p, CPU) for p in demo_dirs)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    outs = [
        build_layer(layer.config, layer.weights, CPU)[0].forward(ForwardInputs(x)).output
        for layer in (bf16, fp8)
    ]
    assert relative_error(outs[1], outs[0]) < 0.08


def test_ensure_demo_layers_rewrites_a_stale_copy(demo_copy: Path):
    cache = demo_copy.parent
    (cache / "demo-fp8").mkdir()
    for f in demo_copy.iterdir():
        (cache / "demo-fp8" / f.name).write_bytes(f.read_bytes())
    _rewrite_manifest(cache / "demo-fp8", name="demo-fp8", tensors_sha256="0" * 64)
    paths = ensure_demo_layers(cache)
    assert [p.name for p in paths] == ["demo", "demo-fp8"]
    assert load_layer(paths[1], CPU).manifest.tensors_sha256 == header_sha256(
        paths[1] / TENSORS_FILE
    )


def test_ensure_demo_layers_rewrites_a_damaged_copy_or_one_without_checksums(tmp_path: Path):
    demo, demo_fp8 = ensure_demo_layers(tmp_path)
    _flip_data_byte(demo, "w2", expert=1)
    manifest = json.loads((demo_fp8 / MANIFEST_FILE).read_text())
    del manifest["tensors_xxh3"]
    (demo_fp8 / MANIFEST_FILE).write_text(json.dumps(manifest))
    ensure_demo_layers(tmp_path)
    for path in (demo, demo_fp8):
        assert load_layer(path, CPU).manifest.tensors_xxh3


def test_load_selected_experts_reads_only_their_slices_in_the_order_asked(demo_dirs: list[Path]):
    full = load_layer(demo_dirs[1], CPU)
    part = load_layer(demo_dirs[1], CPU, experts=[5, 6, 0])
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        expected = getattr(full.weights.experts, name)[[5, 6, 0]]
        assert torch.equal(getattr(part.weights.experts, name), expected), name
    assert torch.equal(part.weights.router.weight, full.weights.router.weight)  # global [E, H]
    assert part.config.num_experts == 8
    assert part.nbytes < full.nbytes


@pytest.mark.parametrize("experts", [[], [1, 1], [8], [-1]], ids=["empty", "dup", "big", "neg"])
def test_load_rejects_bad_expert_ids(demo_dirs: list[Path], experts: list[int]):
    with pytest.raises(ValueError, match=r"distinct ids in \[0, 8\)"):
        load_layer(demo_dirs[0], CPU, experts=experts)


def test_missing_manifest_is_named(tmp_path: Path):
    with pytest.raises(LayerFileError, match=r"manifest\.json: missing: not a layer directory"):
        load_layer(tmp_path, CPU)


def test_invalid_manifest_names_the_field(demo_copy: Path):
    _rewrite_manifest(demo_copy, quant={"scheme": "fp9", "group_size": 128})
    with pytest.raises(LayerFileError, match=r"manifest.json: invalid manifest: quant.scheme"):
        load_layer(demo_copy, CPU)


def test_manifest_that_contradicts_itself_is_refused(demo_copy: Path):
    _rewrite_manifest(demo_copy, num_experts=1)
    with pytest.raises(LayerFileError, match="top_k=2 exceeds num_experts=1"):
        load_layer(demo_copy, CPU)


def test_changed_header_fails_the_hash_check(demo_copy: Path):
    _rewrite_manifest(demo_copy, tensors_sha256="ab" * 32)
    with pytest.raises(LayerFileError, match=r"experts.safetensors: header sha256 .* does not"):
        load_layer(demo_copy, CPU)


def test_tensor_file_that_is_a_directory_is_named_so(demo_copy: Path):
    (demo_copy / TENSORS_FILE).unlink()
    (demo_copy / TENSORS_FILE).mkdir()
    with pytest.raises(LayerFileError, match=r"experts\.safetensors: is not a regular file"):
        load_layer(demo_copy, CPU)


def test_truncated_tensor_file_is_a_clear_error(demo_copy: Path):
    file = demo_copy / TENSORS_FILE
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(LayerFileError, match=r"experts\.safetensors: unreadable safetensors file"):
        load_layer(demo_copy, CPU)


def test_truncated_header_is_a_clear_error(demo_copy: Path):
    file = demo_copy / TENSORS_FILE
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(LayerFileError, match="truncated or not a safetensors file"):
        load_layer(demo_copy, CPU)


def _replace_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write new tensors and manifest hashes that match them, as a buggy writer would."""
    save_file(tensors, path / TENSORS_FILE)
    sums = {n: checksums(t, per_expert=n.startswith("w")) for n, t in tensors.items()}
    _rewrite_manifest(path, tensors_sha256=header_sha256(path / TENSORS_FILE), tensors_xxh3=sums)


def test_wrong_shape_names_the_tensor(demo_copy: Path):
    tensors = load_layer(demo_copy, CPU).weights.tensors()
    tensors["w2_scale"] = tensors["w2_scale"][:, :1].contiguous()
    _replace_tensors(demo_copy, tensors)
    with pytest.raises(LayerFileError, match=r"tensor 'w2_scale': expected shape \[8, 2, 4\]"):
        load_layer(demo_copy, CPU)


def test_wrong_dtype_names_the_tensor(demo_copy: Path):
    tensors = load_layer(demo_copy, CPU).weights.tensors()
    tensors["gate"] = tensors["gate"].float()
    _replace_tensors(demo_copy, tensors)
    with pytest.raises(LayerFileError, match=r"'gate': expected dtype torch.bfloat16, got torch.f"):
        load_layer(demo_copy, CPU)


def test_missing_and_unexpected_tensors_are_named(demo_copy: Path):
    tensors = load_layer(demo_copy, CPU).weights.tensors()
    del tensors["w13_scale"]
    _replace_tensors(demo_copy, tensors)
    with pytest.raises(LayerFileError, match="'w13_scale': missing"):
        load_layer(demo_copy, CPU)
    tensors["w13_scale"] = torch.ones(8, 8, 2)
    tensors["extra"] = torch.zeros(1)
    _replace_tensors(demo_copy, tensors)
    with pytest.raises(LayerFileError, match="'extra': unexpected tensor"):
        load_layer(demo_copy, CPU)


def test_non_finite_scale_is_refused(demo_copy: Path):
    tensors = load_layer(demo_copy, CPU).weights.tensors()
    tensors["w13_scale"][3, 1, 0] = float("nan")
    _replace_tensors(demo_copy, tensors)
    with pytest.raises(LayerFileError, match=r"'w13_scale': holds NaN or Inf .*\[3, 1, 0\]"):
        load_layer(demo_copy, CPU)


def _flip_data_byte(path: Path, tensor: str, expert: int) -> None:
    """Flip one bit in the middle of `expert`'s bytes of `tensor`, header untouched."""
    file = path / TENSORS_FILE
    row = load_file(file)[tensor][expert]
    row_bytes = row.numel() * row.element_size()
    raw = bytearray(file.read_bytes())
    raw[tensor_offsets(file)[tensor] + expert * row_bytes + row_bytes // 2] ^= 0x10
    file.write_bytes(bytes(raw))


@pytest.mark.parametrize("tensor", ["w13", "w2_scale"])
def test_flipped_data_bit_is_refused_by_load_and_inspect_naming_tensor_and_expert(
    demo_copy: Path, tensor: str, capsys: pytest.CaptureFixture[str]
):
    _flip_data_byte(demo_copy, tensor, expert=5)
    match = rf"experts\.safetensors: tensor '{tensor}': xxh3-64 of expert 5's bytes is \w+, the "
    with pytest.raises(LayerFileError, match=match + "manifest says"):
        load_layer(demo_copy, CPU)
    with pytest.raises(LayerFileError, match=match):
        load_layer(demo_copy, CPU, experts=[6, 5])  # an expert-parallel rank checks its own
    load_layer(demo_copy, CPU, experts=[0, 1, 2, 3, 4, 6, 7])  # the others are intact
    assert main(["inspect", str(demo_copy)]) == 1
    assert f"tensor '{tensor}': xxh3-64 of expert 5's bytes" in capsys.readouterr().err


def test_nan_weight_with_matching_checksums_is_refused_by_load_and_inspect(
    demo_dirs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = tmp_path / "layer"
    path.mkdir()
    for f in demo_dirs[0].iterdir():  # bf16 "demo"
        (path / f.name).write_bytes(f.read_bytes())
    tensors = load_layer(path, CPU).weights.tensors()
    tensors["w2"][6, 100, 7] = float("nan")
    _replace_tensors(path, tensors)
    with pytest.raises(LayerFileError, match=r"'w2': holds NaN or Inf \(first at index \[6, 100"):
        load_layer(path, CPU)
    assert main(["inspect", str(path)]) == 1
    assert "tensor 'w2': holds NaN or Inf (first at index [6, 100, 7])" in capsys.readouterr().err


def test_fp8_nan_code_in_a_weight_is_refused(demo_copy: Path):
    tensors = load_layer(demo_copy, CPU).weights.tensors()
    tensors["w13"].view(torch.uint8)[2, 3, 4] = 0xFF  # e4m3fn NaN
    _replace_tensors(demo_copy, tensors)
    with pytest.raises(LayerFileError, match=r"'w13': holds NaN or Inf .*\[2, 3, 4\]"):
        load_layer(demo_copy, CPU)


def test_directory_written_before_checksums_loads_with_a_warning(
    demo_copy: Path, caplog: pytest.LogCaptureFixture
):
    manifest = json.loads((demo_copy / MANIFEST_FILE).read_text())
    del manifest["tensors_xxh3"]
    (demo_copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    loaded = load_layer(demo_copy, CPU)
    assert loaded.manifest.tensors_xxh3 == {}
    assert "written before layer directories carried checksums" in caplog.text


def test_checksum_list_that_does_not_fit_the_tensors_is_refused(demo_copy: Path):
    manifest = json.loads((demo_copy / MANIFEST_FILE).read_text())
    manifest["tensors_xxh3"]["w2"] = manifest["tensors_xxh3"]["w2"][:-1]
    (demo_copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(LayerFileError, match="'w2': tensors_xxh3 lists 7 checksums, expected 8"):
        load_layer(demo_copy, CPU)


def test_written_checksums_are_xxh3_of_each_experts_bytes(demo_dirs: list[Path]):
    manifest = json.loads((demo_dirs[1] / MANIFEST_FILE).read_text())
    tensors = load_file(demo_dirs[1] / TENSORS_FILE)
    w2 = tensors["w2"].view(torch.uint8)
    assert manifest["tensors_xxh3"]["w2"] == [
        xxhash.xxh3_64_hexdigest(w2[e].numpy().tobytes()) for e in range(8)
    ]
    gate = tensors["gate"].view(torch.uint8).numpy().tobytes()
    assert manifest["tensors_xxh3"]["gate"] == [xxhash.xxh3_64_hexdigest(gate)]


def test_write_replaces_a_layer_dir_and_refuses_other_dirs(demo_dirs: list[Path], tmp_path: Path):
    (manifest, weights), _ = demo_layers()
    out = tmp_path / "layer"
    write_layer(out, weights, manifest)
    write_layer(out, weights, manifest.model_copy(update={"name": "renamed"}))
    assert load_layer(out, CPU).name == "renamed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer"]  # no temp dirs left

    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(LayerFileError, match="exists and is not a layer directory"):
        write_layer(other, weights, manifest)
    assert (other / "notes.txt").read_text() == "keep"


def test_failed_write_leaves_nothing_behind(tmp_path: Path):
    (manifest, weights), _ = demo_layers()
    weights.experts.w2 = weights.experts.w2[:, :, :-1]
    with pytest.raises(LayerFileError, match=r"'w2': expected shape \[8, 256, 512\]"):
        write_layer(tmp_path / "layer", weights, manifest)
    assert list(tmp_path.iterdir()) == []


def test_cli_demo_weights_then_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["demo-weights", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "demo"), str(tmp_path / "demo-fp8")]
    assert main(["inspect", str(tmp_path / "demo-fp8")]) == 0
    out = capsys.readouterr().out
    assert '"scheme": "fp8-block"' in out
    assert "w13_scale  float32        [8, 8, 2]" in out


def test_cli_inspect_names_the_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"moe-serve inspect: error: {tmp_path / MANIFEST_FILE}: missing: not a layer directory\n"
    )


def test_header_sha256_covers_length_and_json(tmp_path: Path):
    file = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(2)}, file)
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])

    assert header_sha256(file) == hashlib.sha256(raw[: 8 + length]).hexdigest()


@pytest.mark.parametrize("chunk_bytes", [4096, 64 << 20], ids=["4KiB-chunks", "64MiB-chunks"])
def test_loaded_bytes_equal_safetensors_own_reader(
    demo_dirs: list[Path], chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr("moe_serve.weights.load.READ_CHUNK_BYTES", chunk_bytes)
    for path in demo_dirs:
        expected = load_file(path / TENSORS_FILE)
        loaded = load_layer(path, CPU, experts=[7, 2, 3, 4]).weights.tensors()
        for name, t in expected.items():
            want = t[[7, 2, 3, 4]] if name.startswith("w") else t
            assert torch.equal(loaded[name].view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [None, [6, 7, 0]], ids=["all", "subset"])
def test_cuda_load_equals_cpu_load_through_small_pinned_chunks(
    demo_dirs: list[Path], experts: list[int] | None, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(
        "moe_serve.weights.load.READ_CHUNK_BYTES", 1 << 20
    )  # many turns of both buffers
    for path in demo_dirs:
        on_gpu = load_layer(path, torch.device("cuda"), experts).weights.tensors()
        on_cpu = load_layer(path, CPU, experts).weights.tensors()
        for name, t in on_cpu.items():
            assert on_gpu[name].is_cuda
            assert torch.equal(on_gpu[name].cpu().view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.gpu
def test_cuda_load_checksums_through_pinned_chunks_and_refuses_a_flipped_bit(
    demo_copy: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(
        "moe_serve.weights.load.READ_CHUNK_BYTES", 1 << 16
    )  # rows span several chunks
    load_layer(demo_copy, torch.device("cuda"), experts=[7, 1, 2])
    _flip_data_byte(demo_copy, "w13", expert=2)
    with pytest.raises(LayerFileError, match="'w13': xxh3-64 of expert 2's bytes"):
        load_layer(demo_copy, torch.device("cuda"), experts=[7, 1, 2])
