"""Benchmarks: `python -m bench.run [--quick] [--only NAME]` writes docs/benchmarks.md and plots.

One module per section, named after it, in a package per theme (quality/, bytes/, faults/,
speed/, cluster/); what several sections share is in lib/."""
