"""Benchmarks of spec §8 (benchmarks/README.md, Targets): run with ``python benchmarks/run.py``."""
