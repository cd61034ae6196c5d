"""Test and benchmark helpers, never used at serving time: synthetic models and
tokenizers built on disk (``models``), vLLM server processes (``servers``), private network
namespaces for servers that bind every interface (``netns``)."""
