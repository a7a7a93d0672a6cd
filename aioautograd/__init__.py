"""aioautograd: reverse-mode autograd whose engine is native to asyncio.

``await loss.backward()`` runs the backward pass on per-device executor threads while the
event loop keeps serving; many graphs may backpropagate at once on one engine.
"""

# The tensor module must load first: the ops it imports at its end import it back.
from aioautograd.tensor import Tensor  # isort: skip

import numpy as _np

from aioautograd import devices, graph, nn, optim, profiler
from aioautograd.anomaly_mode import (
    detect_anomaly,
    is_anomaly_check_nan_enabled,
    is_anomaly_enabled,
    set_detect_anomaly,
)
from aioautograd.autograd.hooks import RemovableHandle
from aioautograd.autograd.node import AccumulateGrad, GraphRoot, Node
from aioautograd.checkpoint import checkpoint
from aioautograd.devices.device import Device, device
from aioautograd.engine.api import backward, backward_sync, grad, grad_sync
from aioautograd.engine.engine import (
    Engine,
    get_default_engine,
    offload,
    queue_callback,
    set_default_engine,
)
from aioautograd.engine.policy import EnginePolicy
from aioautograd.engine.watchdog import BlockedWorkerWarning
from aioautograd.factories import (
    arange,
    as_tensor,
    empty,
    from_dlpack,
    from_numpy,
    full,
    full_like,
    manual_seed,
    ones,
    ones_like,
    rand,
    rand_like,
    randint,
    randn,
    randn_like,
    tensor,
    zeros,
    zeros_like,
)
from aioautograd.function import Function, FunctionCtx, once_differentiable
from aioautograd.grad_mode import (
    enable_grad,
    inference_mode,
    is_grad_enabled,
    no_grad,
    set_grad_enabled,
)
from aioautograd.gradcheck import GradcheckError, gradcheck, gradgradcheck
from aioautograd.ops.arithmetic import (
    add,
    div,
    masked_fill,
    maximum,
    minimum,
    mul,
    neg,
    pow,
    sub,
    where,
)
from aioautograd.ops.indexing import gather, index_select
from aioautograd.ops.linalg import matmul, norm
from aioautograd.ops.reduction import (
    all,
    any,
    cumsum,
    log_softmax,
    logsumexp,
    max,
    mean,
    min,
    softmax,
    std,
    sum,
    var,
    var_mean,
)
from aioautograd.ops.shape import (
    cat,
    chunk,
    expand,
    flatten,
    narrow,
    permute,
    reshape,
    split,
    squeeze,
    stack,
    transpose,
    unsqueeze,
)
from aioautograd.ops.unary import (
    abs,
    clamp,
    cos,
    exp,
    gelu,
    log,
    relu,
    sigmoid,
    sin,
    sqrt,
    tanh,
)

grad_fn = Node

float16 = _np.dtype("float16")
float32 = _np.dtype("float32")
float64 = _np.dtype("float64")
int32 = _np.dtype("int32")
int64 = _np.dtype("int64")
bool_ = _np.dtype("bool")

__version__ = "0.1.0"

__all__ = [
    "AccumulateGrad",
    "BlockedWorkerWarning",
    "Device",
    "Engine",
    "EnginePolicy",
    "Function",
    "FunctionCtx",
    "GradcheckError",
    "GraphRoot",
    "Node",
    "RemovableHandle",
    "Tensor",
    "__version__",
    "abs",
    "add",
    "all",
    "any",
    "arange",
    "as_tensor",
    "backward",
    "backward_sync",
    "bool_",
    "cat",
    "checkpoint",
    "chunk",
    "clamp",
    "cos",
    "cumsum",
    "detect_anomaly",
    "device",
    "devices",
    "div",
    "empty",
    "enable_grad",
    "exp",
    "expand",
    "flatten",
    "float16",
    "float32",
    "float64",
    "from_dlpack",
    "from_numpy",
    "full",
    "full_like",
    "gather",
    "gelu",
    "get_default_engine",
    "grad",
    "grad_fn",
    "grad_sync",
    "gradcheck",
    "gradgradcheck",
    "graph",
    "index_select",
    "inference_mode",
    "int32",
    "int64",
    "is_anomaly_check_nan_enabled",
    "is_anomaly_enabled",
    "is_grad_enabled",
    "log",
    "log_softmax",
    "logsumexp",
    "manual_seed",
    "masked_fill",
    "matmul",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "mul",
    "narrow",
    "neg",
    "nn",
    "no_grad",
    "norm",
    "offload",
    "once_differentiable",
    "ones",
    "ones_like",
    "optim",
    "permute",
    "pow",
    "profiler",
    "queue_callback",
    "rand",
    "rand_like",
    "randint",
    "randn",
    "randn_like",
    "relu",
    "reshape",
    "set_default_engine",
    "set_detect_anomaly",
    "set_grad_enabled",
    "sigmoid",
    "sin",
    "softmax",
    "split",
    "sqrt",
    "squeeze",
    "stack",
    "std",
    "sub",
    "sum",
    "tanh",
    "tensor",
    "transpose",
    "unsqueeze",
    "var",
    "var_mean",
    "where",
    "zeros",
    "zeros_like",
]
