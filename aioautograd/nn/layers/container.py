"""Containers: `Sequential` chains modules, `ModuleList` holds them in a list."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, overload

from aioautograd.nn.module import Module


def _index(index: int, length: int) -> int:
    if not -length <= index < length:
        raise IndexError(f"index {index} is out of range")
    return index % length


class Sequential(Module):
    """Runs its modules in order, feeding each output to the next.

    Built from modules (named ``"0"``, ``"1"``, ...) or from one ``OrderedDict`` of names to
    modules. Indexing with an int returns a module, with a slice a new ``Sequential``.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> model[0]
        Linear(in_features=2, out_features=16, bias=True)
    """

    @overload
    def __init__(self, *args: Module) -> None: ...

    @overload
    def __init__(self, arg: OrderedDict[str, Module], /) -> None: ...

    def __init__(self, *args: Any) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for name, module in args[0].items():
                self.add_module(name, module)
        else:
            for position, module in enumerate(args):
                self.add_module(str(position), module)

    def forward(self, input: Any) -> Any:
        for module in self._modules.values():
            if module is not None:
                input = module(input)
        return input

    @overload
    def __getitem__(self, index: int) -> Module: ...

    @overload
    def __getitem__(self, index: slice) -> Sequential: ...

    def __getitem__(self, index: int | slice) -> Module | Sequential:
        items = [(name, module) for name, module in self._modules.items() if module is not None]
        if isinstance(index, slice):
            return Sequential(OrderedDict(items[index]))
        return items[_index(index, len(items))][1]

    def __len__(self) -> int:
        return sum(module is not None for module in self._modules.values())

    def __iter__(self) -> Iterator[Module]:
        return (module for module in self._modules.values() if module is not None)

    def append(self, module: Module) -> Sequential:
        """Add ``module`` at the end; returns self."""
        self.add_module(str(len(self)), module)
        return self


class ModuleList(Module):
    """A list of modules, each registered (so its parameters are found); no ``forward``.

    Example:
        >>> layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        >>> len(list(layers.parameters()))
        6
    """

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.extend(modules)

    @overload
    def __getitem__(self, index: int) -> Module: ...

    @overload
    def __getitem__(self, index: slice) -> ModuleList: ...

    def __getitem__(self, index: int | slice) -> Module | ModuleList:
        modules = list(self)
        if isinstance(index, slice):
            return ModuleList(modules[index])
        return modules[_index(index, len(modules))]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return (module for module in self._modules.values() if module is not None)

    def append(self, module: Module) -> ModuleList:
        """Add ``module`` at the end; returns self."""
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> ModuleList:
        """Add each of ``modules`` at the end; returns self."""
        for module in modules:
            self.append(module)
        return self
