"""moe-serve: Mixture-of-Experts layers as a service.

The importable package. Its parts live in the repository's top-level folders, linked here:
`moe_serve.kernels` (the modular kernel), `moe_serve.weights` (layer directories),
`moe_serve.service` (HTTP and gRPC serving) and `moe_serve.bench` (benchmarks).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("moe-serve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
