"""Benchmarks: `python -m bench.run [--quick] [--only NAME]` writes docs/benchmarks.md and plots."""
