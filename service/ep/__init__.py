"""Expert parallelism: rank 0's engine, the rank group, the other ranks."""
