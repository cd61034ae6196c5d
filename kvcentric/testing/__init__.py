"""Test and benchmark helpers (synthetic models, fixtures); not used at serving time."""
