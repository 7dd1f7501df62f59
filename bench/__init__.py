"""Benchmarks: kernels (`python -m bench.kernels`), quality (`python -m bench.quality`)."""
