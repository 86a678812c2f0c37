"""Hugging Face MoE checkpoints -> one layer directory: `convert_checkpoint` in `pipeline.py`."""
