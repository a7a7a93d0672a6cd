"""`Module`: the base of every layer, with PyTorch's registration of parameters, buffers and
submodules through attribute assignment.

Assigning a :class:`Parameter` to an attribute registers it in ``_parameters``, a
``Module`` in ``_modules``, and a tensor named by :meth:`Module.register_buffer` in
``_buffers``; ``__getattr__`` finds them there again. Every walk over the module tree
(``modules()``, ``parameters()``, ``state_dict()``) is an explicit pre-order traversal, so
a deep model never meets the recursion limit and the order is PyTorch's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np

from aioautograd.devices.device import Device, is_device_spec
from aioautograd.devices.device import device as as_device
from aioautograd.grad_mode import no_grad
from aioautograd.nn.parameter import Parameter
from aioautograd.tensor import Tensor

__all__ = ["Module"]

_ModuleT = TypeVar("_ModuleT", bound="Module")


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class Module:
    """Base class of neural-network modules; subclasses assign layers in ``__init__`` and
    define ``forward``.

    Example:
        >>> class MLP(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.hidden = nn.Linear(2, 16)
        ...         self.out = nn.Linear(16, 2)
        ...
        ...     def forward(self, x: ag.Tensor) -> ag.Tensor:
        ...         return self.out(F.relu(self.hidden(x)))
        >>> [name for name, _ in MLP().named_parameters()]
        ['hidden.weight', 'hidden.bias', 'out.weight', 'out.bias']

    A module holds no per-call state, so one module may run forward (and its graphs
    backward) from many asyncio tasks at once; gradients of concurrent backward passes
    accumulate into the same ``.grad`` safely.
    """

    training: bool
    _parameters: dict[str, Parameter | None]
    _buffers: dict[str, Tensor | None]
    _non_persistent_buffers_set: set[str]
    _modules: dict[str, Module | None]

    def __init__(self) -> None:
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_non_persistent_buffers_set", set())
        object.__setattr__(self, "_modules", {})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The computation of this module; every subclass overrides it."""
        raise NotImplementedError(
            f'Module [{type(self).__name__}] is missing the required "forward" function'
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    # ------------------------------------------------------------------- registration
    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Add ``param`` (or ``None``, a declared-but-absent parameter) under ``name``.

        Raises:
            AttributeError: before ``Module.__init__()`` ran.
            KeyError: for an empty name, a name with ``"."``, or an existing attribute.
            TypeError: if ``param`` is not a :class:`Parameter` or ``None``.
            ValueError: if ``param`` is not a leaf tensor.
        """
        if "_parameters" not in self.__dict__:
            raise AttributeError("cannot assign parameter before Module.__init__() call")
        self._check_new_name(name, "parameter", self._parameters)
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(
                f"cannot assign '{type(param).__name__}' object to parameter '{name}' "
                "(Parameter or None required)"
            )
        if param is not None and not param.is_leaf:
            raise ValueError(
                f"Cannot assign non-leaf Tensor to parameter '{name}'. Model parameters must "
                "be created explicitly; to express one as a function of another, compute it "
                "in forward()."
            )
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """Add a tensor that is state but not a parameter (e.g. running statistics).

        Buffers move with :meth:`to` and, when ``persistent``, appear in :meth:`state_dict`.

        Raises:
            AttributeError: before ``Module.__init__()`` ran.
            KeyError: for an empty name, a name with ``"."``, or an existing attribute.
            TypeError: if ``tensor`` is not a Tensor or ``None``.
        """
        if "_buffers" not in self.__dict__:
            raise AttributeError("cannot assign buffer before Module.__init__() call")
        self._check_new_name(name, "buffer", self._buffers)
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(
                f"cannot assign '{type(tensor).__name__}' object to buffer '{name}' "
                "(Tensor or None required)"
            )
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers_set.discard(name)
        else:
            self._non_persistent_buffers_set.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        """Add ``module`` as a child named ``name`` (``register_module`` is an alias).

        Raises:
            KeyError: for an empty name, a name with ``"."``, or an existing attribute.
            TypeError: if ``module`` is not a Module or ``None``.
        """
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self._check_new_name(name, "module", self._modules)
        self._modules[name] = module

    register_module = add_module

    def _check_new_name(self, name: str, kind: str, table: Mapping[str, Any]) -> None:
        if not isinstance(name, str):
            raise TypeError(f"{kind} name should be a string. Got {type(name).__name__}")
        if not name:
            raise KeyError(f'{kind} name can\'t be empty string ""')
        if "." in name:
            raise KeyError(f'{kind} name can\'t contain ".", got: {name}')
        if name not in table and (name in self.__dict__ or hasattr(type(self), name)):
            raise KeyError(f"attribute '{name}' already exists")

    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        modules = self.__dict__.get("_modules")
        buffers = self.__dict__.get("_buffers")
        if isinstance(value, Parameter):
            if params is None:
                raise AttributeError("cannot assign parameters before Module.__init__() call")
            self._forget(name, self.__dict__, buffers, modules)
            self.register_parameter(name, value)
        elif params is not None and name in params:
            if value is not None:
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as parameter '{name}' "
                    "(Parameter or None expected)"
                )
            params[name] = None
        elif isinstance(value, Module):
            if modules is None:
                raise AttributeError("cannot assign module before Module.__init__() call")
            self._forget(name, self.__dict__, params, buffers)
            modules[name] = value
        elif modules is not None and name in modules:
            if value is not None:
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as child module '{name}' "
                    "(Module or None expected)"
                )
            modules[name] = None
        elif buffers is not None and name in buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as buffer '{name}' "
                    "(Tensor or None expected)"
                )
            buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    @staticmethod
    def _forget(name: str, *tables: dict[str, Any] | None) -> None:
        for table in tables:
            if table is not None:
                table.pop(name, None)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: look in the registries.
        state = self.__dict__
        for table_name in ("_parameters", "_buffers", "_modules"):
            table = state.get(table_name)
            if table is not None and name in table:
                return table[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for table_name in ("_parameters", "_buffers", "_modules"):
            table = self.__dict__[table_name]
            if name in table:
                del table[name]
                self._non_persistent_buffers_set.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self) -> list[str]:
        names = set(super().__dir__())
        names.update(self._parameters, self._buffers, self._modules)
        return sorted(names)

    # ------------------------------------------------------------------------ walking
    def named_modules(
        self, memo: set[int] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Module]]:
        """Every module of the tree, this one first, in pre-order, with dotted names.

        A module reachable twice is yielded once unless ``remove_duplicate`` is false.
        """
        seen = memo if memo is not None else set()
        stack: list[tuple[str, Module]] = [(prefix, self)]
        while stack:
            name, module = stack.pop()
            if remove_duplicate:
                if id(module) in seen:
                    continue
                seen.add(id(module))
            yield name, module
            children = [
                (f"{name}.{child_name}" if name else child_name, child)
                for child_name, child in module._modules.items()
                if child is not None
            ]
            stack.extend(reversed(children))

    def modules(self) -> Iterator[Module]:
        """Every module of the tree, this one first."""
        for _, module in self.named_modules():
            yield module

    def named_children(self) -> Iterator[tuple[str, Module]]:
        """The direct submodules with their attribute names (each module once)."""
        seen: set[int] = set()
        for name, module in self._modules.items():
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield name, module

    def children(self) -> Iterator[Module]:
        """The direct submodules."""
        for _, module in self.named_children():
            yield module

    def _named_members(
        self, table_name: str, prefix: str, recurse: bool, remove_duplicate: bool
    ) -> Iterator[tuple[str, Tensor]]:
        modules = (
            self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
            if recurse
            else iter([(prefix, self)])
        )
        seen: set[int] = set()
        for module_prefix, module in modules:
            table: dict[str, Tensor | None] = module.__dict__[table_name]
            for name, member in table.items():
                if member is None or (remove_duplicate and id(member) in seen):
                    continue
                seen.add(id(member))
                yield (f"{module_prefix}.{name}" if module_prefix else name), member

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Parameter]]:
        """``(name, parameter)`` pairs, e.g. ``("0.weight", ...)``; shared ones once."""
        for name, param in self._named_members("_parameters", prefix, recurse, remove_duplicate):
            yield name, cast(Parameter, param)  # the _parameters table holds Parameters

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """The parameters of this module and (``recurse``) its submodules, each once.

        Example:
            >>> optimizer = optim.SGD(model.parameters(), lr=0.1)
        """
        for _, param in self.named_parameters(recurse=recurse):
            yield param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        """``(name, buffer)`` pairs of this module and (``recurse``) its submodules."""
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        """The buffers of this module and (``recurse``) its submodules."""
        for _, buffer in self.named_buffers(recurse=recurse):
            yield buffer

    def apply(self: _ModuleT, fn: Callable[[Module], None]) -> _ModuleT:
        """Call ``fn`` on every submodule (children first, as PyTorch) and on ``self``."""
        for module in reversed(list(self.modules())):
            fn(module)
        return self

    # ------------------------------------------------------------------------- modes
    def train(self: _ModuleT, mode: bool = True) -> _ModuleT:
        """Set training mode (``mode=True``) or evaluation mode on every module; returns self.

        Layers such as :class:`Dropout` read ``self.training``.

        Raises:
            ValueError: if ``mode`` is not a bool.
        """
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        for module in self.modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self: _ModuleT) -> _ModuleT:
        """Evaluation mode: ``train(False)``."""
        return self.train(False)

    def requires_grad_(self: _ModuleT, requires_grad: bool = True) -> _ModuleT:
        """Set ``requires_grad`` on every parameter (e.g. ``False`` to freeze); returns self."""
        for param in self.parameters():
            param.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of all parameters.

        Args:
            set_to_none: drop each ``.grad`` (the default, as PyTorch) instead of filling it
                with zeros in place; the next backward then allocates fresh gradients.
        """
        _zero_grads(self.parameters(), set_to_none)

    # ------------------------------------------------------------------- state dicts
    def state_dict(self, *, prefix: str = "", keep_vars: bool = False) -> OrderedDict[str, Any]:
        """Parameters and persistent buffers by dotted name, each as a NumPy array copy.

        Per module in pre-order: its parameters, then its buffers. A shared tensor appears
        under every name that reaches it. With ``keep_vars=True`` the tensors themselves are
        returned instead of copies.
        """
        result: OrderedDict[str, Any] = OrderedDict()
        for module_prefix, module in self.named_modules(prefix=prefix, remove_duplicate=False):
            dot = f"{module_prefix}." if module_prefix else ""
            for name, tensor in module._state_items():
                result[dot + name] = tensor if keep_vars else _numpy_copy(tensor)
        return result

    def _state_items(self) -> Iterator[tuple[str, Tensor]]:
        for name, param in self._parameters.items():
            if param is not None:
                yield name, param
        for name, buffer in self._buffers.items():
            if buffer is not None and name not in self._non_persistent_buffers_set:
                yield name, buffer

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> _IncompatibleKeys:
        """Copy ``state_dict`` (name -> array or tensor) into the parameters and buffers.

        Values are copied in place (under ``no_grad``), so optimizers keep working on the
        same parameter objects; each copy bumps the tensor's version counter. Nothing is
        copied unless every check passes.

        Args:
            strict: require the keys to match :meth:`state_dict` exactly.

        Returns:
            A named tuple ``(missing_keys, unexpected_keys)``.

        Raises:
            RuntimeError: listing the missing and unexpected keys (when ``strict``) and every
                shape mismatch (always).
        """
        targets = self.state_dict(keep_vars=True)
        missing = [key for key in targets if key not in state_dict]
        unexpected = [key for key in state_dict if key not in targets]
        errors: list[str] = []
        if strict:
            if missing:
                errors.append(
                    "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + "."
                )
            if unexpected:
                errors.append(
                    "Unexpected key(s) in state_dict: "
                    + ", ".join(f'"{k}"' for k in unexpected)
                    + "."
                )
        for key, target in targets.items():
            if key in state_dict:
                shape = tuple(np.shape(_unwrap(state_dict[key])))
                if shape != tuple(target.shape):
                    errors.append(
                        f"size mismatch for {key}: copying a param with shape {shape} from "
                        f"checkpoint, the shape in current model is {tuple(target.shape)}."
                    )
        if errors:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}:\n\t"
                + "\n\t".join(errors)
            )
        with no_grad():
            for key, target in targets.items():
                if key in state_dict:
                    value = state_dict[key]
                    target.copy_(value.detach() if isinstance(value, Tensor) else value)
        return _IncompatibleKeys(missing, unexpected)

    # ----------------------------------------------------------------- device, dtype
    def to(self: _ModuleT, *args: Any, **kwargs: Any) -> _ModuleT:
        """Move (``to("cuda:0")``) and/or cast (``to(ag.float64)``) parameters and buffers in
        place; returns self.

        The parameter objects stay the same (their ``data`` and ``device`` are replaced), so
        an optimizer built before the move keeps working. Casting touches only floating-point
        tensors, as in PyTorch. Gradients move and cast with their parameters.
        """
        target_device, target_dtype = _parse_to_args(args, kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        with no_grad():
            for tensor in tensors:
                _convert_in_place(tensor, target_device, target_dtype)
                if tensor.grad is not None:
                    _convert_in_place(tensor.grad, target_device, target_dtype)
        return self

    def cpu(self: _ModuleT) -> _ModuleT:
        return self.to("cpu")

    def cuda(self: _ModuleT, device: int | None = None) -> _ModuleT:
        return self.to("cuda" if device is None else f"cuda:{device}")

    def float(self: _ModuleT) -> _ModuleT:
        return self.to(np.float32)

    def double(self: _ModuleT) -> _ModuleT:
        return self.to(np.float64)

    def half(self: _ModuleT) -> _ModuleT:
        return self.to(np.float16)

    # -------------------------------------------------------------------------- repr
    def extra_repr(self) -> str:
        """The text inside this module's parentheses in ``repr``; layers override it."""
        return ""

    def _get_name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        lines: list[str] = []
        extra = self.extra_repr()
        if extra:
            lines.extend(extra.split("\n"))
        for name, module in self._modules.items():
            child = _add_indent(repr(module), 2)
            lines.append(f"({name}): {child}")
        main = self._get_name() + "("
        if lines:
            if len(lines) == 1 and not self._modules:
                main += lines[0]
            else:
                main += "\n  " + "\n  ".join(lines) + "\n"
        return main + ")"


def _add_indent(text: str, spaces: int) -> str:
    first, *rest = text.split("\n")
    if not rest:
        return first
    return "\n".join([first, *((" " * spaces) + line for line in rest)])


def _zero_grads(params: Iterator[Tensor] | list[Tensor], set_to_none: bool) -> None:
    """Shared by ``Module.zero_grad`` and ``Optimizer.zero_grad``."""
    with no_grad():
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            if set_to_none:
                param.grad = None
                continue
            if grad.grad_fn is not None:
                grad.detach_()
            else:
                grad.requires_grad_(False)
            grad.zero_()


def _numpy_copy(tensor: Tensor) -> np.ndarray[Any, Any]:
    data = tensor.data
    if tensor.device.type == "cuda":
        host: np.ndarray[Any, Any] = data.get()  # cupy -> a new NumPy array
        return host
    return np.array(data, copy=True)


def _unwrap(value: Any) -> Any:
    """Something ``np.shape`` understands: a tensor's array (CuPy arrays have ``.shape``)."""
    return value.data if isinstance(value, Tensor) else value


def _parse_to_args(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Device | None, np.dtype[Any] | None]:
    target_device: Device | None = None
    target_dtype: np.dtype[Any] | None = None
    for value in (*args, kwargs.pop("device", None), kwargs.pop("dtype", None)):
        if value is None:
            continue
        if is_device_spec(value):
            target_device = as_device(value)
        else:
            target_dtype = np.dtype(value)
            if target_dtype.kind not in "fc":
                raise TypeError(
                    f"nn.Module.to only accepts floating point or complex dtypes, but got "
                    f"desired dtype={target_dtype}"
                )
    if kwargs:
        raise TypeError(f"to() got unexpected keyword arguments {sorted(kwargs)}")
    return target_device, target_dtype


def _convert_in_place(
    tensor: Tensor, target_device: Device | None, target_dtype: np.dtype[Any] | None
) -> None:
    converted = tensor.detach()
    if target_dtype is not None and converted.dtype.kind in "fc":
        converted = converted.to(target_dtype)
    if target_device is not None:
        converted = converted.to(target_device)
    if converted.data is not tensor.data:
        tensor.data = converted.data
        tensor.device = converted.device
