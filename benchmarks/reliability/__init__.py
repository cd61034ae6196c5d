"""Reliability: faults injected under load, and soaks (memory, descriptors, leases)."""
