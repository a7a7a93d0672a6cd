"""The layers of ``aioautograd.nn``, one module per family."""

from aioautograd.nn.layers.activation import GELU, ReLU
from aioautograd.nn.layers.container import ModuleList, Sequential
from aioautograd.nn.layers.conv import Conv2d
from aioautograd.nn.layers.dropout import Dropout
from aioautograd.nn.layers.embedding import Embedding
from aioautograd.nn.layers.flatten import Flatten
from aioautograd.nn.layers.linear import Linear
from aioautograd.nn.layers.loss import CrossEntropyLoss, MSELoss
from aioautograd.nn.layers.normalization import LayerNorm

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
    "ModuleList",
    "ReLU",
    "Sequential",
]
