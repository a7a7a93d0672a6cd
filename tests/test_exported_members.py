"""The public API: everything in __all__ exists, and nothing private leaks."""

from __future__ import annotations

import aioautograd as ag


def test_all_names_exist_and_are_sorted() -> None:
    for name in ag.__all__:
        assert hasattr(ag, name), name
    assert list(ag.__all__) == sorted(set(ag.__all__))


def test_spec_names_are_exported() -> None:
    required = {
        "tensor",
        "zeros",
        "ones",
        "randn",
        "rand",
        "arange",
        "full",
        "zeros_like",
        "ones_like",
        "from_numpy",
        "from_dlpack",
        "Tensor",
        "Function",
        "no_grad",
        "enable_grad",
        "set_grad_enabled",
        "is_grad_enabled",
        "detect_anomaly",
        "backward",
        "grad",
        "backward_sync",
        "grad_sync",
        "get_default_engine",
        "queue_callback",
        "checkpoint",
        "gradcheck",
        "Node",
        "grad_fn",
        "once_differentiable",
        "nn",
    }
    assert required <= set(ag.__all__)


def test_engine_singleton() -> None:
    assert ag.get_default_engine() is ag.Engine.get_default_engine()
