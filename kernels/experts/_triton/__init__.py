"""@triton.jit bodies of the `triton` and `triton-batched` experts (API: kernels/experts/triton.py),
and the pair sort of `oai-triton`.

    align.py         sort (token, slot) pairs by expert, each expert's run padded to BLOCK_M
    grouped_gemm.py  one grouped GEMM: gather rows -> dequantise weights -> dot -> epilogue
    topk_sum.py      sum each token's k weighted rows
    sort_pairs.py    sort pairs by expert for triton_kernels' gather/scatter GEMMs
    quantize.py      dynamic fp8 quantisation of activation rows (tensor / token / 1x128 groups)
    graphs.py        decode: one CUDA graph per token count
    tiles.py         tile sizes per layer shape and M bucket: tuned JSON files or a heuristic

Without a CUDA device these kernels can only run in Triton's interpreter (the CPU tests). Triton
picks compiled or interpreted when a kernel is decorated, so the choice is made here, before
any kernel module is imported; selection still offers these backends on CUDA only.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
