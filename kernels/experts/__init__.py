"""Experts backends: GEMM1 -> activation -> GEMM2 over the routed token copies."""
