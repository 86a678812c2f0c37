"""Benchmarks: kernel forwards against measured hardware ceilings, and the HTTP service under load.

moe-serve bench kernels   -> bench/results/DEVICE-DATE.json (schema: bench/schema.py)
moe-serve bench plot FILE -> PNGs and a markdown summary beside FILE
moe-serve bench http      -> throughput and latency of a running server
"""
