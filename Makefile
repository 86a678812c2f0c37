# Set-up and the two everyday commands. Each target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Where an NVIDIA driver is installed, PyPI's CUDA build of torch (it brings triton); elsewhere
# the CPU build 2.13.0, which lies on the CI/dev machines' disk. Override with TORCH=...
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

.PHONY: serve test lint

# pip's own lines (each package collected, its download's progress bar) show the install moving;
# the build backend's notes on editable installs are setuptools', not ours: PYTHONWARNINGS keeps
# them out.
PIP := PYTHONWARNINGS=ignore $(BIN)/pip install --progress-bar on

$(BIN)/moe-serve: pyproject.toml
	@echo "[1/3] creating $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade pip
	@echo "[2/3] installing $(TORCH) (a minute or more)"
	@$(PIP) "$(TORCH)" "numpy<2.4"
	@echo "[3/3] installing moe-serve and its dependencies into $(VENV)"
	@$(PIP) -e ".[test]"
	@touch $@
	@echo "installed: $(BIN)/moe-serve"

serve: $(BIN)/moe-serve  ## run the service on the embedded demo layer (CPU when no GPU is present)
	$(BIN)/moe-serve serve $(ARGS)

# GPU-marked tests are left out on any machine: on a GPU they run one process per file
# (tests/gpu_suite.sh, DEVELOPERS.md), since tests of different files share CUDA state
test: lint  ## lint, then the CPU test suite
	$(BIN)/python -m pytest -q -m "not gpu" $(ARGS)

lint: $(BIN)/moe-serve  ## ruff check and ruff format --check: style never drifts
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
