"""Micro-benchmarks: one component against its floor, measured in the same run."""
