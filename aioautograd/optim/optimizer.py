"""`Optimizer`: parameter groups, per-parameter state, ``zero_grad`` and state dicts, as in
``torch.optim.Optimizer``.

Subclasses implement ``_update`` (one parameter). Updates run under ``no_grad``: the
parameters are changed only through in-place tensor ops (``add_``, ``mul_``, ``copy_``),
so every step bumps their version counters and a graph that saved a parameter before the
step refuses to backpropagate through the stale value. Intermediate arithmetic is done on
the ``.data`` arrays with each parameter's array module (NumPy or CuPy), never
round-tripping the host.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from aioautograd.grad_mode import enable_grad, no_grad
from aioautograd.nn.module import _numpy_copy, _zero_grads
from aioautograd.tensor import Tensor

__all__ = ["Optimizer", "required"]


class _RequiredParameter:
    """The default of a hyperparameter that every parameter group must give."""

    def __repr__(self) -> str:
        return "<required parameter>"


required: Any = _RequiredParameter()

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


class Optimizer:
    """Base class of the optimizers.

    Args:
        params: an iterable of tensors, or of dicts (parameter groups) each holding
            ``"params"`` and any hyperparameters that override ``defaults``.
        defaults: the default hyperparameters of every group.

    Example:
        >>> optimizer = optim.SGD(
        ...     [{"params": model.base.parameters()},
        ...      {"params": model.head.parameters(), "lr": 1e-3}],
        ...     lr=1e-2, momentum=0.9)

    Raises:
        TypeError: if ``params`` is a single tensor, or a group holds a non-tensor.
        ValueError: if ``params`` is empty, a parameter is not a leaf, a parameter appears
            in two groups, or a group lacks a required hyperparameter.

    An optimizer is not safe to ``step`` from two threads at once; from asyncio tasks on
    one loop, ``step`` is synchronous and so atomic with respect to other tasks.
    """

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        self.defaults = defaults
        self.state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        self.param_groups: list[dict[str, Any]] = []
        if isinstance(params, Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or "
                f"dicts, but got {type(params).__name__}"
            )
        # Either every item is a tensor or every item is a group dict (checked below).
        groups: list[Any] = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters (with optional hyperparameter overrides), e.g. to
        train a layer unfrozen part way through training.

        Raises:
            TypeError: if the group holds something other than tensors.
            ValueError: for a non-leaf tensor, a parameter already in another group, or a
                missing required hyperparameter.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but the "
                "ordering of tensors in sets will change between runs. Please use a list "
                "instead."
            )
        params = list(params)
        for param in params:
            if not isinstance(param, Tensor):
                raise TypeError(
                    f"optimizer can only optimize Tensors, but one of the params is "
                    f"{type(param).__name__}"
                )
            if not param.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor")
        group = {**param_group, "params": params}
        for name, default in self.defaults.items():
            if default is required and name not in group:
                raise ValueError(
                    "parameter group didn't specify a value of required optimization "
                    f"parameter {name}"
                )
            group.setdefault(name, default)
        seen = {id(p) for existing in self.param_groups for p in existing["params"]}
        if len({id(p) for p in params}) != len(params) or seen & {id(p) for p in params}:
            raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every optimized parameter.

        Args:
            set_to_none: drop each ``.grad`` (the default) instead of zeroing it in place.
        """
        _zero_grads([p for group in self.param_groups for p in group["params"]], set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the parameters from their ``.grad``; returns ``closure()`` if given.

        ``closure`` is a synchronous callable that recomputes the loss (with
        ``loss.backward_sync()``); it runs with grad mode enabled. Updates run under
        ``no_grad`` with in-place ops, so they bump the parameters' version counters.
        """
        loss = self._closure_loss(closure)
        with no_grad():
            for group in self.param_groups:
                for param in self._params_with_grad(group):
                    self._update(param, group)
        return loss

    def _update(self, param: Tensor, group: dict[str, Any]) -> None:
        """Update one parameter from its gradient (each optimizer's rule)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _update")

    def _closure_loss(self, closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with enable_grad():
            return closure()

    def _params_with_grad(self, group: dict[str, Any]) -> Iterator[Tensor]:
        for param in group["params"]:
            if param.grad is not None:
                yield param

    # ------------------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state: ``{"state": {index: {...}}, "param_groups": [...]}``.

        Parameters are named by their index in the order of ``param_groups`` (as PyTorch);
        tensors in the state are copied to NumPy arrays, so the result is independent of
        later steps.
        """
        index_of: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            indices = []
            for param in group["params"]:
                indices.append(index_of.setdefault(id(param), len(index_of)))
            groups.append({**copy.deepcopy(_hyperparameters(group)), "params": indices})
        state = {
            index_of[id(param)]: {
                key: _numpy_copy(value) if isinstance(value, Tensor) else copy.deepcopy(value)
                for key, value in values.items()
            }
            for param, values in self.state.items()
            if id(param) in index_of
        }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` onto this optimizer's parameters.

        Hyperparameters of each group are replaced; state arrays become tensors on each
        parameter's device (floating ones cast to its dtype).

        Raises:
            ValueError: if the number of groups or of parameters per group differs.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                "loaded state dict has a different number of parameter groups "
                f"({len(groups)} vs {len(self.param_groups)})"
            )
        for saved, current in zip(groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(current["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size "
                    f"of optimizer's group ({len(saved['params'])} vs {len(current['params'])})"
                )
        param_of = {
            index: param
            for saved, current in zip(groups, self.param_groups, strict=True)
            for index, param in zip(saved["params"], current["params"], strict=True)
        }
        new_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for index, values in state_dict["state"].items():
            param = param_of.get(int(index))
            if param is None:
                continue
            new_state[param] = {
                key: _state_value(key, value, param) for key, value in values.items()
            }
        self.state = new_state
        for saved, current in zip(groups, self.param_groups, strict=True):
            current.update(copy.deepcopy(_hyperparameters(saved)))

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for index, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {index}")
            for key in sorted(_hyperparameters(group)):
                lines.append(f"    {key}: {group[key]}")
        lines.append(")")
        return "\n".join(lines)


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _state_value(key: str, value: Any, param: Tensor) -> Any:
    """A saved state entry as live state: arrays become tensors beside ``param``."""
    if isinstance(value, Tensor):
        value = _numpy_copy(value)
    if not isinstance(value, np.ndarray) and not hasattr(value, "__cuda_array_interface__"):
        return copy.deepcopy(value)
    xp = param.xp
    dtype = param.dtype if value.dtype.kind in "fc" and key != "step" else value.dtype
    return Tensor(xp.array(value, dtype=dtype, copy=True), param.device)
