"""`Adam` and `AdamW` (Adam with decoupled weight decay)."""

from __future__ import annotations

import math
from typing import Any

from aioautograd.optim.optimizer import Optimizer, ParamsT
from aioautograd.tensor import Tensor

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """Adam (Kingma & Ba), with PyTorch's update rule at step ``t``::

        g = grad + weight_decay * p        (or p = p * (1 - lr * weight_decay) if decoupled)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        v_max = max(v_max, v)              (amsgrad; v_max replaces v below)
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    State per parameter: ``step`` (an int), ``exp_avg``, ``exp_avg_sq`` and, with
    ``amsgrad``, ``max_exp_avg_sq``.

    Raises:
        ValueError: for a negative ``lr``, ``eps`` or ``weight_decay`` or a beta outside
            ``[0, 1)``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        super().__init__(params, defaults)

    def _update(self, param: Tensor, group: dict[str, Any]) -> None:
        assert param.grad is not None
        xp = param.xp
        grad = param.grad.data
        if group["maximize"]:
            grad = -grad
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = Tensor(xp.zeros_like(param.data), param.device)
            state["exp_avg_sq"] = Tensor(xp.zeros_like(param.data), param.device)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = Tensor(xp.zeros_like(param.data), param.device)
        state["step"] += 1
        step = state["step"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]

        exp_avg = state["exp_avg"].data
        exp_avg_sq = state["exp_avg_sq"].data
        if weight_decay != 0:
            if group["decoupled_weight_decay"]:
                param.mul_(1 - lr * weight_decay)
            else:
                decay = xp.multiply(param.data, weight_decay, out=xp.empty_like(exp_avg))
                grad = xp.add(grad, decay, out=decay)
        # One parameter-sized scratch array serves every temporary below (``out=``); the
        # operations and their order are the textbook formula's, so the results are bitwise
        # those of the out-of-place expressions (``out`` is explicit: a 0-d operation would
        # return a scalar):
        #   exp_avg += (1 - beta1) * (grad - exp_avg)
        #   exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
        #   p -= step_size * exp_avg / (sqrt(v) / sqrt(1 - beta2**t) + eps)
        scratch = xp.subtract(grad, exp_avg, out=xp.empty_like(exp_avg))
        scratch *= 1 - beta1
        exp_avg += scratch
        exp_avg_sq *= beta2
        xp.multiply(grad, 1 - beta2, out=scratch)
        scratch *= grad
        exp_avg_sq += scratch

        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        second_moment = exp_avg_sq
        if group["amsgrad"]:
            second_moment = state["max_exp_avg_sq"].data
            xp.maximum(second_moment, exp_avg_sq, out=second_moment)
        denom = xp.sqrt(second_moment, out=scratch)
        denom /= bias_correction2_sqrt
        denom += eps
        update = xp.divide(exp_avg, denom, out=denom)
        if param.device.fused is None:
            # What ``add_(alpha=-step_size)`` computes (the product, then the sum), in place.
            update *= -step_size
            param.add_(Tensor(update, param.device))
        else:
            param.add_(Tensor(update, param.device), alpha=-step_size)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): each step first shrinks the
    parameters, ``p = p * (1 - lr * weight_decay)``, instead of adding ``weight_decay * p``
    to the gradient. ``weight_decay`` defaults to ``1e-2``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            decoupled_weight_decay=True,
        )
