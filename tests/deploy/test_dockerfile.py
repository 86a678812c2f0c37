"""The Dockerfile: hadolint, its pins against pyproject.toml, what reaches the final stage, and
its package install run for real in a fresh venv (the image build itself needs a container
engine and a CUDA host, so it does not run here)."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.deploy.files import DOCKERFILE, ROOT, Stage

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SRC = "/src"  # where the build stage copies the package
BUILD_TOOLS = {"git", "cmake", "make", "ninja-build", "build-essential", "pip"}


def package_install(build: Stage) -> list[str]:
    """The argv of the build stage's `pip install "/src[extras]"`."""
    runs = [c.words() for c in build.all("RUN")]
    found = [argv for argv in runs if any(a.startswith(f"{SRC}[") for a in argv)]
    assert len(found) == 1, f"expected one RUN installing {SRC}[...], found {found}"
    return found[0]


def copies(build: Stage) -> list[tuple[list[str], str]]:
    """(build-context sources, destination) of each COPY of the build stage (not --from)."""
    found = []
    for copy in build.all("COPY"):
        *sources, dest = copy.words()
        if not any(s.startswith("--") for s in sources):
            found.append((sources, dest))
    return found


def copied_sources(build: Stage) -> set[str]:
    return {src for sources, _ in copies(build) for src in sources}


def requirement(reqs: list[str], name: str) -> Requirement:
    return next(r for r in map(Requirement, reqs) if r.name == name)


@pytest.fixture(scope="module")
def build(stages: list[Stage]) -> Stage:
    return next(s for s in stages if s.name == "build")


@pytest.fixture(scope="module")
def runtime(stages: list[Stage]) -> Stage:
    return stages[-1]


def test_hadolint_finds_nothing() -> None:
    hadolint = Path(sysconfig.get_path("scripts")) / "hadolint"
    result = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_stages_build_on_cuda_devel_and_run_on_cuda_runtime(stages: list[Stage]) -> None:
    assert [s.name for s in stages] == ["build", "runtime"]
    assert stages[0].base.startswith("nvidia/cuda:") and "-devel-" in stages[0].base
    assert stages[1].base.startswith("nvidia/cuda:") and "-runtime-" in stages[1].base


def test_package_is_installed_with_extras_that_pyproject_defines(build: Stage) -> None:
    spec = next(a for a in package_install(build) if a.startswith(SRC))
    extras = set(spec.removeprefix(f"{SRC}[").removesuffix("]").split(","))
    assert "gpu" in extras
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"])


def test_torch_and_triton_pins_satisfy_pyproject(build: Stage) -> None:
    pins = build.args()
    torch = requirement(PYPROJECT["project"]["dependencies"], "torch")
    triton = requirement(PYPROJECT["project"]["optional-dependencies"]["gpu"], "triton")
    assert torch.specifier.contains(pins["TORCH_VERSION"])
    assert triton.specifier.contains(pins["TRITON_VERSION"])


def test_external_backends_are_installed_as_pyproject_extras_pin_them(build: Stage) -> None:
    """DeepGEMM and triton_kernels install before the code is copied, so the Dockerfile spells
    out the `deepgemm` and `oai` extras: the same requirements, character for character."""
    pins = build.args()
    words = [w for c in build.all("RUN") for w in c.words() if " @ git+" in w]
    installed = {re.sub(r"\$\{(\w+)\}", lambda m: pins[m.group(1)], w) for w in words}
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert installed == set(extras["deepgemm"] + extras["oai"])
    assert len(pins["DEEPGEMM_COMMIT"]) == 40  # a full hash: a branch or short hash can move
    assert re.fullmatch(r"v\d+\.\d+\.\d+", pins["TRITON_KERNELS_TAG"])  # a release tag


def test_every_packaged_directory_is_copied_into_the_build(build: Stage) -> None:
    patterns = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {
        p.parent.name
        for p in ROOT.glob("*/__init__.py")
        if any(fnmatch.fnmatch(p.parent.name, pat) for pat in patterns)
    }
    copied = copied_sources(build)
    assert packages and packages <= copied
    assert {"pyproject.toml", "README.md"} <= copied  # the build reads both


def test_dockerignore_keeps_out_tests_results_weights_and_local_tooling(build: Stage) -> None:
    ignored = {line for line in (ROOT / ".dockerignore").read_text().splitlines() if line}
    must = {"tests", "bench/results", "weights-data", "**/*.safetensors", ".venv", ".git"}
    assert must | {".whl", ".deps", "deploy"} <= ignored
    assert not copied_sources(build) & ignored


def test_runtime_stage_has_no_build_tooling_and_only_the_venv_from_build(runtime: Stage) -> None:
    words = {w for c in runtime.all("RUN") for w in c.words()}
    assert "apt-get" in words  # the check below reads the install line
    assert not words & BUILD_TOOLS
    assert [c.words() for c in runtime.all("COPY")] == [["--from=build", "/opt/venv", "/opt/venv"]]


def test_runtime_runs_moe_serve_as_non_root_on_every_interface(runtime: Stage) -> None:
    assert runtime.env()["MOE_SERVE_HOST"] == "0.0.0.0"
    assert runtime.all("USER")[-1].value.split(":")[0] not in {"0", "root"}
    assert runtime.all("ENTRYPOINT")[-1].exec_form() == ["moe-serve", "serve"]
    healthcheck = runtime.all("HEALTHCHECK")[-1]
    assert " CMD [" in healthcheck.value and "/ready" in healthcheck.exec_form()[-1]


@pytest.mark.slow
def test_dockerfile_package_install_works_in_a_fresh_venv(build: Stage, tmp_path: Path) -> None:
    """The build stage's COPY lines and `pip install "/src[...]"`, run in a fresh venv that also
    sees this venv's packages (its CPU torch in place of the image's CUDA one, which is GBs to
    fetch): a file the install needs but the Dockerfile does not copy, or an extra it names
    that pyproject lacks, fails here. What this venv lacks comes from the package index."""
    image = tmp_path / "image"  # stands for the build stage's filesystem root
    for sources, dest in copies(build):
        target = image / dest.lstrip("/")
        for source in sources:
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target)
    venv = tmp_path / "venv"
    # no pip of its own (ensurepip takes seconds): this venv's, on the path line below, runs in it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--no-cache-dir"]
    fresh = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # A path line, not a site dir: this venv's own .pth files (its editable moe-serve) stay out.
    (Path(fresh) / "outer-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    argv = package_install(build)
    args = [
        a.replace(SRC, str(image / SRC.lstrip("/")), 1) for a in argv[argv.index("install") + 1 :]
    ]
    subprocess.run([*pip, *args], check=True, timeout=600)
    # What the image's ENTRYPOINT and HEALTHCHECK then run.
    usage = subprocess.run(
        [str(venv / "bin" / "moe-serve"), "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "MOE_SERVE_PORT" in usage.stdout
    installed = subprocess.run(
        [python, "-c", "import moe_serve; print(moe_serve.__file__)"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert installed.startswith(fresh), installed  # the image's copy, not this checkout
