"""The Conductor: a KVCache-centric router (see router/app.py)."""
