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
        xp = param.xp
        grad = param.grad.data
        # ``owned``: ``grad`` is a temporary of this update, free to be overwritten. Each
        # step below writes into such arrays with ``out=`` instead of allocating another
        # parameter-sized temporary; the operations and their order are the textbook
        # formula's, so the results are bitwise those of the out-of-place expressions. (An
        # explicit ``out`` everywhere: a 0-d operation would return a scalar, not an array.)
        owned = False
        if group["maximize"]:
            grad, owned = xp.negative(grad, out=xp.empty_like(grad)), True
        weight_decay = group["weight_decay"]
        if weight_decay != 0:
            decay = xp.multiply(param.data, weight_decay, out=xp.empty_like(grad))
            grad, owned = xp.add(grad, decay, out=decay), True
        momentum = group["momentum"]
        if momentum != 0:
            state = self.state[param]
            buffer = state.get("momentum_buffer")
            if buffer is None:
                buffer = Tensor(xp.array(grad, copy=True), param.device)
                state["momentum_buffer"] = buffer
            else:
                buffer.data *= momentum
                dampening = group["dampening"]
                if dampening == 0:
                    buffer.data += grad  # (1 - 0) * grad is grad: no scaled copy
                elif owned:  # nesterov needs dampening 0: grad is not read again
                    buffer.data += xp.multiply(grad, 1 - dampening, out=grad)
                else:
                    buffer.data += (1 - dampening) * grad
            if group["nesterov"]:
                scaled = xp.multiply(buffer.data, momentum, out=xp.empty_like(grad))
                grad, owned = xp.add(grad, scaled, out=scaled), True
            else:
                grad, owned = buffer.data, False
        if owned and param.device.fused is None:
            # What ``add_(alpha=-lr)`` computes (``grad * -lr``, then the sum), in place.
            param.add_(Tensor(xp.multiply(grad, -group["lr"], out=grad), param.device))
        else:
            param.add_(Tensor(grad, param.device), alpha=-group["lr"])
