"""Benchmarks, tuning and the performance page: `moe-serve bench kernels | service | ep | tune |
report` (bench/cli.py). Results: bench/results/<gpu>/<bench>-<date>-<commit>.json (bench/schema.py);
docs/performance.md is made from them. Nothing in kernels/ or service/ imports this package.
"""
