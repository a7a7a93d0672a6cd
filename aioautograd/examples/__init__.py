"""Runnable examples: ``python -m aioautograd.examples.demo``."""
