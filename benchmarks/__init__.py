"""kvcentric's benchmarks, grouped by the question they answer; each runs as
``python -m benchmarks.<group>.<name>`` from the repository root. The index of every
benchmark (its question, command and result files) is ``benchmarks/README.md``, generated
by ``python -m benchmarks.lib.index``.

- :mod:`benchmarks.micro`: one component against its floor (store, kernels, lookups,
  the GPU path, integrity, CUDA graph modes, the router's decision).
- :mod:`benchmarks.serving`: real engines under load (the load generator, side-by-side
  comparisons, TTFT, connectors, capacity knee, tiers, the router's overhead).
- :mod:`benchmarks.sim`: cluster and cache simulations over Mooncake's traces.
- :mod:`benchmarks.reliability`: faults injected under load, and soaks.
- :mod:`benchmarks.lib`: what they share (results writer, report, procfs, plots, stubs).
"""
