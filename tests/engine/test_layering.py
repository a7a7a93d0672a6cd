"""The engine's layer: it runs nodes on arrays and tensors and knows no op module.

``aioautograd/engine/`` and ``aioautograd/autograd/`` (the nodes) may use ``Tensor`` and its
methods, never ``aioautograd.ops`` directly, at module level or inside a function: ops sit
above the engine, and a reduction or cast the engine needs goes through the ``Tensor``
method (``sum_to_size``, ``to``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import aioautograd

_PACKAGE = Path(aioautograd.__file__).parent
_LOWER = ("engine", "autograd")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("layer", _LOWER)
def test_lower_layers_import_no_op_module(layer: str) -> None:
    offenders = {
        f"{path.relative_to(_PACKAGE)}: {name}"
        for path in sorted((_PACKAGE / layer).glob("*.py"))
        for name in _imports(path)
        if name == "aioautograd.ops" or name.startswith("aioautograd.ops.")
    }
    assert not offenders, f"aioautograd/{layer} imports ops: {sorted(offenders)}"


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from aioautograd.ops import reduction\n")
    assert "aioautograd.ops.reduction" in _imports(module)


_BELOW_ENGINE = ("tensor.py", "function.py", "ops/*.py", "autograd/*.py")


def _module_level_imports(path: Path) -> list[str]:
    names = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.append(node.module)
    return names


def test_tensor_ops_and_nodes_import_the_engine_only_late() -> None:
    """The engine imports ``Tensor``; the modules below it reach the engine only through
    ``tensor._engine_api`` (bound on first use), so the engine is in no import cycle."""
    offenders = {
        f"{path.relative_to(_PACKAGE)}: {name}"
        for pattern in _BELOW_ENGINE
        for path in sorted(_PACKAGE.glob(pattern))
        for name in _module_level_imports(path)
        if name == "aioautograd.engine" or name.startswith("aioautograd.engine.")
    }
    assert not offenders, f"module-level engine imports below the engine: {sorted(offenders)}"
