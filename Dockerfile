# syntax=docker/dockerfile:1
# moe-serve for NVIDIA GPUs: `docker compose up -d` builds and runs it (docs/deploy.md).
#
# What is pinned, and where it comes from (tests/deploy checks these lines against pyproject):
# - Base images: nvidia/cuda 13.0.2 on Ubuntu 24.04 (Docker Hub; Python 3.12 from Ubuntu).
#   Pinned by tag; pin by digest (`@sha256:...`) where builds must be bit-for-bit repeatable.
# - torch 2.11.0 from PyPI: its Linux wheel is the CUDA 13.0 build (it requires
#   cuda-toolkit 13.0.2 and triton==3.6.0). This is the stack our H100 figures were measured on.
# - DeepGEMM 2.6.1 (deepseek-ai/DeepGEMM at a full commit hash) and OpenAI's triton_kernels
#   (the triton repository's python/triton_kernels at release tag v3.5.1, the copy vLLM vendors;
#   later tags drop `triton_kernels.routing`): from source, as pyproject's `deepgemm` and `oai`
#   extras say, since neither has a working wheel on PyPI (docs/backends.md).

ARG CUDA_IMAGE_VERSION=13.0.2
ARG UBUNTU=ubuntu24.04

# ---- build: compilers, git and the CUDA toolkit live only here ---------------------------------
FROM nvidia/cuda:${CUDA_IMAGE_VERSION}-devel-${UBUNTU} AS build
ARG TORCH_VERSION=2.11.0
ARG TRITON_VERSION=3.6.0
ARG DEEPGEMM_COMMIT=54e22612409371d6364144b69086735beb54e98b
ARG TRITON_KERNELS_TAG=v3.5.1
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu's package versions are not pinned (DL3008): the archive drops superseded versions, so a
# pin breaks the build within weeks; the base image tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev git build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

RUN pip install "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"

# The external backends: the `deepgemm` and `oai` extras of pyproject.toml, spelled out here so
# they install before the code is copied (a code change does not rebuild DeepGEMM); tests/deploy
# checks these requirements against pyproject. pip fetches DeepGEMM's submodules (CUTLASS, fmt)
# at the commits it records. Its setup.py imports torch, so it builds against the torch above,
# without isolation; DG_FORCE_BUILD: compile here, never download a wheel from its release page.
RUN pip install setuptools==80.9.0 wheel==0.45.1 packaging==25.0 \
    && DG_FORCE_BUILD=1 pip install --no-build-isolation \
        "deep_gemm @ git+https://github.com/deepseek-ai/DeepGEMM.git@${DEEPGEMM_COMMIT}"
RUN pip install \
    "triton_kernels @ git+https://github.com/triton-lang/triton.git@${TRITON_KERNELS_TAG}#subdirectory=python/triton_kernels"

# The package last: code changes rebuild only this layer.
COPY pyproject.toml README.md /src/
COPY kernels /src/kernels
COPY weights /src/weights
COPY service /src/service
COPY bench /src/bench
COPY moe_serve /src/moe_serve
RUN pip install "/src[gpu]"

# ---- runtime ----------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_IMAGE_VERSION}-runtime-${UBUNTU} AS runtime
# What the two JITs need at run time (no git, cmake, pip build backends or devel toolkit):
# - Triton compiles a small C launcher per kernel signature: gcc and the Python headers.
# - DeepGEMM compiles each GEMM shape with nvcc on first use (host compiler g++, CUDA headers).
ARG CUDA_APT_SUFFIX=13-0
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 libpython3-dev gcc g++ \
        "cuda-nvcc-${CUDA_APT_SUFFIX}" "cuda-cudart-dev-${CUDA_APT_SUFFIX}" \
        "cuda-cccl-${CUDA_APT_SUFFIX}" \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 moe \
    && useradd --uid 10001 --gid moe --create-home moe \
    && mkdir -p /cache \
    && chown moe:moe /cache
COPY --from=build /opt/venv /opt/venv

# Configuration is by environment only (MOE_SERVE_*, service/settings.py). The app binds
# loopback by default; in a container it must listen on every interface to be reachable.
# /cache keeps compiled kernels across restarts when a volume is mounted there.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    CUDA_HOME=/usr/local/cuda \
    MOE_SERVE_HOST=0.0.0.0 \
    MOE_SERVE_PORT=8000 \
    MOE_SERVE_CACHE_DIR=/cache/moe-serve \
    TRITON_CACHE_DIR=/cache/triton \
    DG_JIT_CACHE_DIR=/cache/deep_gemm
USER 10001:10001
WORKDIR /home/moe
EXPOSE 8000
# /ready turns 200 once every layer is loaded and warmed up (the first kernel compiles included):
# the long start period leaves a large layer room to load before failures count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=15m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request as r; r.urlopen('http://127.0.0.1:' + os.environ['MOE_SERVE_PORT'] + '/ready', timeout=4)"]
ENTRYPOINT ["moe-serve", "serve"]
