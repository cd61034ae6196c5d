"""Simulations over Mooncake's traces: routing policies on a P/D cluster model, and the
store's hit rate vs capacity."""
