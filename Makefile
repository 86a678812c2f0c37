# Set-up and the two everyday commands. Each target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Where an NVIDIA driver is installed, PyPI's CUDA build of torch (it brings triton); elsewhere
# the CPU build 2.13.0, which lies on the CI/dev machines' disk. Override with TORCH=...
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

.PHONY: serve test lint

$(BIN)/moe-serve: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" "numpy<2.4"
	$(BIN)/pip install -q -e ".[test]"
	@touch $@

serve: $(BIN)/moe-serve  ## run the service on the embedded demo layer (CPU when no GPU is present)
	$(BIN)/moe-serve serve $(ARGS)

test: lint  ## lint, then the whole test suite (GPU-marked tests skip on a machine without CUDA)
	$(BIN)/python -m pytest -q $(ARGS)

lint: $(BIN)/moe-serve  ## ruff check and ruff format --check: style never drifts
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
