"""moe-serve's modular MoE kernel: routing, quantisation, prepare/finalize and experts stages.

Has no dependency on the service. Read `modular.py` and `experts/reference.py` first.
"""
