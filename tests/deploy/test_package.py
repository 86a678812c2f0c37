"""What `pip install .` puts into site-packages: the one package `moe_serve` (its parts the
top-level folders, linked into moe_serve/) and its dist-info; nothing named kernels, service,
weights or bench lands beside other projects' packages."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy.files import ROOT

PARTS = ("kernels", "service", "weights", "bench")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
        check=True,
        env=os.environ | {"PYTHONWARNINGS": "ignore"},
    )
    (built,) = out.glob("*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_holds_only_the_moe_serve_package(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/", 1)[0] for name in wheel.namelist()}
    assert tops == {"moe_serve", next(t for t in tops if t.endswith(".dist-info"))}


def test_every_part_and_its_data_is_in_the_package(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for part in PARTS:
        sources = {
            f"moe_serve/{p.relative_to(ROOT).as_posix()}"
            for p in (ROOT / part).rglob("*.py")
            if "results" not in p.parts
        }
        assert sources <= names, sorted(sources - names)[:5]
    tuned = {f"moe_serve/kernels/tuned/{p.name}" for p in (ROOT / "kernels/tuned").glob("*.json")}
    assert tuned and tuned <= names


def test_the_entry_point_is_the_packages_cli(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = (n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "moe-serve = moe_serve.service.cli:main" in wheel.read(entry_points).decode()


def test_the_links_point_at_the_top_level_folders() -> None:
    for part in PARTS:
        link = ROOT / "moe_serve" / part
        assert link.is_symlink() and Path(os.readlink(link)) == Path("..", part)
