"""Compatibility: which engine versions the connector serves, and their hooks."""
