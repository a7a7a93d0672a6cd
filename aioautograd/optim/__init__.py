"""Optimizers (``aioautograd.optim``): `SGD`, `Adam`, `AdamW` on the `Optimizer` base."""

from aioautograd.optim.adam import Adam, AdamW
from aioautograd.optim.optimizer import Optimizer
from aioautograd.optim.sgd import SGD

__all__ = ["Adam", "AdamW", "Optimizer", "SGD"]
