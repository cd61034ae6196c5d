"""Shared by the benchmarks: paths, the results writer, the report, /proc readers, plots,
the stub engine and the benchmark index."""
