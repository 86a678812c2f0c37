"""Prepare/finalize stages: how tokens reach the experts and how their outputs come back."""
