"""A pytest plugin that makes ``import torch`` fail, as if PyTorch were not installed.

Run the suite with ``python -m pytest -p tests.no_torch`` to check that a test catches a
wrong gradient without the torch oracle: the ``torch`` fixture then skips, and so does every
``pytest.importorskip("torch")``.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any


class _BlockTorch(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> Any:
        if fullname == "torch" or fullname.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by tests.no_torch)")
        return None


if any(name == "torch" or name.startswith("torch.") for name in sys.modules):
    raise RuntimeError("tests.no_torch: torch was imported before the plugin could block it")
sys.meta_path.insert(0, _BlockTorch())
