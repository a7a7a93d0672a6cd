"""`SGD`: stochastic gradient descent with momentum, dampening, Nesterov and weight decay."""

from __future__ import annotations

from typing import Any

from aioautograd.optim.optimizer import Optimizer, ParamsT
from aioautograd.tensor import Tensor

__all__ = ["SGD"]


class SGD(Optimizer):
    """Stochastic gradient descent, with PyTorch's update rule::

        g = grad + weight_decay * p                     (negated first if maximize)
        b = g                 on the first step, else   b = momentum * b + (1 - dampening) * g
        g = g + momentum * b  if nesterov,      else    g = b          (when momentum != 0)
        p = p - lr * g

    The momentum buffer lives in ``optimizer.state[p]["momentum_buffer"]``.

    Raises:
        ValueError: for a negative ``lr``, ``momentum`` or ``weight_decay``, or ``nesterov``
            without momentum or with dampening.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _update(self, param: Tensor, group: dict[str, Any]) -> None:
        assert param.grad is not None
        grad = param.grad.data
        if group["maximize"]:
            grad = -grad
        weight_decay = group["weight_decay"]
        if weight_decay != 0:
            grad = grad + weight_decay * param.data
        momentum = group["momentum"]
        if momentum != 0:
            state = self.state[param]
            buffer = state.get("momentum_buffer")
            if buffer is None:
                buffer = Tensor(param.xp.array(grad, copy=True), param.device)
                state["momentum_buffer"] = buffer
            else:
                buffer.data *= momentum
                buffer.data += (1 - group["dampening"]) * grad
            grad = grad + momentum * buffer.data if group["nesterov"] else buffer.data
        param.add_(Tensor(grad, param.device), alpha=-group["lr"])
