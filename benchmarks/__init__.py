"""Benchmarks of SPEC §8: run with ``python benchmarks/run.py``."""
