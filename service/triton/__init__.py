"""Triton's extensions: shared memory, the model repository, statistics."""
