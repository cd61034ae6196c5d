"""Tools the benchmarks share: results writer, report, index, /proc readers, plots, stubs."""
