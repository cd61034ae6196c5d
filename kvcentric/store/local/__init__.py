"""The embedded ``local`` backend: a shared-memory arena plus a metadata coordinator."""
