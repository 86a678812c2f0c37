"""The engine: the batcher, the 3-stream device pipeline, the layers it runs."""
