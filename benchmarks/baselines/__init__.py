"""Frozen earlier versions of the package's kernels, kept for the benchmarks that time today's against them (not part
of the package)."""
