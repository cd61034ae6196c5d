"""Simulations over Mooncake's traces (no engine): routing policies, hit rate vs capacity."""
