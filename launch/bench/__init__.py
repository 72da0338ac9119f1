"""Benchmarks and measurements behind docs/benchmarks.md (``python -m launch.bench.NAME`` or ``python launch/bench/NAME.py``)."""
