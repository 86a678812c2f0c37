"""Measured tables, one JSON file each: Triton tiles per layer shape (`E*_H*_I*_*.json`, read by
kernels/experts/_triton/tiles.py) and the `--backend auto` rules per GPU (`auto_*.json`, read by
kernels/selection.py).

Each says where its numbers come from, as data: the GPU (a tile file's `key.device_name`, a rule
table's `device`) and the PROVENANCE fields: the commit of the code measured, the date (UTC) and
the command that measured it. A tile file carries them per bucket (`moe-serve bench tune` writes
the buckets it searches, a file may hold buckets of several runs); a rule table for the whole
table (`moe-serve bench tune --mode rules` of a `moe-serve bench kernels` run), and a rule of its
own where `--merge` kept it from another run.
"""

from pathlib import Path

TUNED_DIR = Path(__file__).parent
PROVENANCE = ("commit", "date", "command")
