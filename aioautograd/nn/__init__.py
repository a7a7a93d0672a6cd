"""Neural-network building blocks: `Module`, `Parameter`, layers, `functional` and `init`."""

from aioautograd.nn import functional, init
from aioautograd.nn.layers import (
    GELU,
    Conv2d,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    Flatten,
    LayerNorm,
    Linear,
    ModuleList,
    MSELoss,
    ReLU,
    Sequential,
)
from aioautograd.nn.module import Module
from aioautograd.nn.parameter import Parameter

__all__ = [
    "Conv2d",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "Flatten",
    "GELU",
    "LayerNorm",
    "Linear",
    "MSELoss",
    "Module",
    "ModuleList",
    "Parameter",
    "ReLU",
    "Sequential",
    "functional",
    "init",
]
