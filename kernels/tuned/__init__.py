"""Measured tables, one JSON file each: Triton tiles per layer shape (`E*_H*_I*_*.json`, read by
kernels/experts/_triton/tiles.py) and the `--backend auto` rules per GPU (`auto_*.json`, read by
kernels/selection.py)."""

from pathlib import Path

TUNED_DIR = Path(__file__).parent
