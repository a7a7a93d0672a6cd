"""Behaviour that PyTorch users rely on (issue #14, "Behaviour that differs").

Each test states PyTorch's documented behaviour as explicit expectations on aioautograd and,
where torch is installed, runs the same program on torch and compares.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close


@pytest.fixture(params=["aioautograd", "torch"])
def lib(request: pytest.FixtureRequest) -> Any:
    """Each library the behaviour is checked on: aioautograd, and torch as the reference."""
    if request.param == "torch":
        return pytest.importorskip("torch")
    return ag


@pytest.fixture
def th() -> Any:
    """torch when installed, else None (the aioautograd half of each test still runs)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _edge_kinds(node: Any) -> list[str | None]:
    """``next_functions`` as kinds, comparable across the libraries."""
    kinds: list[str | None] = []
    for next_node, _ in node.next_functions:
        if next_node is None:
            kinds.append(None)
        elif "AccumulateGrad" in next_node.name():
            kinds.append("AccumulateGrad")
        else:
            kinds.append(next_node.name())
    return kinds


def _graph_names(tensor: Any) -> list[str]:
    """Node names of ``tensor``'s graph, depth first (``torch::autograd::`` stripped)."""
    names: list[str] = []
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        names.append(node.name().removeprefix("torch::autograd::"))
        stack.extend(reversed([n for n, _ in node.next_functions]))
    return names


def _functions(lib: Any) -> Any:
    """The custom Functions the tests use, defined against ``lib`` (ag or torch)."""
    base = lib.Function if lib is ag else lib.autograd.Function

    class Identity(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad

    class WithCount(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return 3, x * 2

        @staticmethod
        def backward(ctx: Any, grad_count: Any, grad: Any) -> Any:
            ctx.seen = (grad_count, grad)
            return grad * 2

    class NoGrad(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x * 1

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return None

    class Pass(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x * 1

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad

    class Mixed(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, a: Any, index: Any, n: int, b: Any) -> Any:
            return a * n + b

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad * 2, None, None, grad

    return Identity, WithCount, NoGrad, Pass, Mixed


def _ones(lib: Any, *shape: int) -> Any:
    return lib.ones(*shape, requires_grad=True)


def _backward(lib: Any, loss: Any, **kwargs: Any) -> None:
    if lib is ag:
        loss.backward_sync(**kwargs)
    else:
        loss.backward(**kwargs)


def _grad(lib: Any, *args: Any, **kwargs: Any) -> Any:
    return ag.grad_sync(*args, **kwargs) if lib is ag else lib.autograd.grad(*args, **kwargs)


# ----------------------------------------------------------------------- custom Functions
def test_function_returning_its_input_returns_a_view(lib: Any) -> None:
    identity = _functions(lib)[0]
    x = _ones(lib, 3)
    y = identity.apply(x)
    assert y is not x
    assert x.is_leaf
    assert x.grad_fn is None
    assert not y.is_leaf
    assert y.grad_fn.name().endswith("IdentityBackward")
    assert y._base is x
    _backward(lib, y.sum())
    assert_close(x.grad, np.ones(3))

    a = x * 2
    b = identity.apply(a)
    assert b is not a
    assert b._base is a
    assert a.grad_fn.name() == "MulBackward0"


def test_function_may_return_non_tensor_outputs(lib: Any) -> None:
    with_count = _functions(lib)[1]
    x = _ones(lib, 3)
    count, y = with_count.apply(x)
    assert count == 3
    _backward(lib, y.sum())
    assert_close(x.grad, np.full(3, 2.0))  # what backward returned: grad * 2
    grad_count, grad = y.grad_fn.seen
    assert grad_count is None  # never materialized: there is no tensor to shape it
    assert_close(grad, np.ones(3))


def test_nested_grad_sync_in_a_custom_backward_keeps_grad_mode(lib: Any) -> None:
    seen: list[bool] = []
    base = lib.Function if lib is ag else lib.autograd.Function

    class Nested(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return x * 1

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            seen.append(lib.is_grad_enabled())
            with lib.enable_grad():
                inner = x.detach().requires_grad_()
                (inner_grad,) = _grad(lib, (inner * inner).sum(), inner)
                seen.append(lib.is_grad_enabled())
                seen.append(bool((inner * 2).requires_grad))
            seen.append(lib.is_grad_enabled())
            return g * inner_grad

    x = _ones(lib, 3)
    _backward(lib, Nested.apply(x).sum())
    assert_close(x.grad, np.full(3, 2.0))
    assert seen == [False, True, True, False]


def test_none_from_a_custom_backward_leaves_grad_none(lib: Any) -> None:
    _, _, no_grad_fn, pass_fn, _ = _functions(lib)
    x = _ones(lib, 3)
    middle = x * 2
    hooked: list[Any] = []
    middle.register_hook(hooked.append)
    _backward(lib, no_grad_fn.apply(middle).sum())
    assert x.grad is None  # the built-in MulBackward0 passed None on, not zeros
    assert hooked == [None]

    # A custom Function materializes it (set_materialize_grads defaults to True).
    x = _ones(lib, 3)
    _backward(lib, no_grad_fn.apply(pass_fn.apply(x)).sum())
    assert_close(x.grad, np.zeros(3))


# ----------------------------------------------------------------------------------- hooks
def test_accumulate_grad_post_hook_receives_the_gradient(lib: Any) -> None:
    x = _ones(lib, 3)
    y = x * 2
    accumulator = y.grad_fn.next_functions[0][0]
    calls: list[tuple[Any, Any]] = []
    accumulator.register_hook(
        lambda grad_inputs, grad_outputs: calls.append((grad_inputs, grad_outputs))
    )
    _backward(lib, y.sum())
    ((grad_inputs, grad_outputs),) = calls
    assert grad_inputs == ()
    assert len(grad_outputs) == 1
    assert_close(grad_outputs[0], np.full(3, 2.0))
    assert_close(x.grad, np.full(3, 2.0))


def test_tensor_hooks_see_none_for_unused_outputs(lib: Any) -> None:
    x = _ones(lib, 3, 2)
    a, b, c = x.unbind(0)
    seen: dict[str, Any] = {}
    a.register_hook(lambda g: seen.__setitem__("a", g))
    b.register_hook(lambda g: seen.__setitem__("b", g))
    c.retain_grad()
    _backward(lib, a.sum())
    assert_close(seen["a"], np.ones(2))
    assert "b" in seen
    assert seen["b"] is None
    assert c.grad is None
    assert_close(x.grad, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])

    # Several outputs of a custom Function: the unused one's hook sees None too.
    x = _ones(lib, 4)
    first, second = x.split(2)
    second.register_hook(lambda g: seen.__setitem__("second", g))
    _backward(lib, first.sum())
    assert seen["second"] is None

    # A hook may not replace None by a gradient; the engine keeps working afterwards.
    x = _ones(lib, 3, 2)
    a, b, _ = x.unbind(0)
    b.register_hook(lambda g: lib.ones(2))
    with pytest.raises(RuntimeError, match="can't replace a None gradient"):
        _backward(lib, a.sum())
    x = _ones(lib, 3)
    _backward(lib, (x * 3).sum())
    assert_close(x.grad, np.full(3, 3.0))


def test_retain_grad_follows_an_in_place_op(lib: Any) -> None:
    x = _ones(lib, 3)
    a = x * 1
    a.retain_grad()
    before: list[Any] = []
    a.register_hook(before.append)  # stays with the version it was registered on
    a.mul_(2)
    _backward(lib, a.sum())
    assert_close(a.grad, np.ones(3))
    assert_close(before[0], np.full(3, 2.0))
    assert_close(x.grad, np.full(3, 2.0))


# -------------------------------------------------------------------------- backward / grad
def test_backward_inputs_may_be_one_multi_element_tensor(lib: Any) -> None:
    x = _ones(lib, 3)
    other = _ones(lib, 3)
    _backward(lib, (x * 2 + other).sum(), inputs=x)
    assert_close(x.grad, np.full(3, 2.0))
    assert other.grad is None


def test_backward_inputs_non_leaf_runs_its_node_hooks(lib: Any) -> None:
    x = _ones(lib, 3)
    a = x * 2
    prehook: list[Any] = []
    tensor_hook: list[Any] = []
    a.grad_fn.register_prehook(lambda grads: prehook.append(grads))
    a.register_hook(tensor_hook.append)
    _backward(lib, (a * 3).sum(), inputs=[a])
    assert len(prehook) == 1
    assert_close(prehook[0][0], np.full(3, 3.0))
    assert_close(tensor_hook[0], np.full(3, 3.0))
    assert_close(a.grad, np.full(3, 3.0))
    assert a.retains_grad
    assert x.grad is None


def test_materialized_grads_require_grad_under_create_graph(lib: Any) -> None:
    for create_graph in (False, True):
        x = _ones(lib, 3)
        unused = _ones(lib, 3)
        gx, gu = _grad(
            lib,
            (x * x).sum(),
            [x, unused],
            create_graph=create_graph,
            materialize_grads=True,
        )
        assert_close(gu, np.zeros(3))
        assert gu.requires_grad is create_graph
        assert gu.is_leaf
        assert gx.requires_grad is create_graph


def test_grad_with_empty_inputs_raises(lib: Any) -> None:
    x = _ones(lib, 3)
    with pytest.raises(RuntimeError, match=r"`inputs` argument to `grad\(\)` cannot be empty"):
        _grad(lib, (x * 2).sum(), [])


# ---------------------------------------------------------------------------- graph shape
_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "x + 2": lambda m, x: x + 2,
    "2 + x": lambda m, x: 2 + x,
    "x - 2": lambda m, x: x - 2,
    "2 - x": lambda m, x: 2 - x,
    "2 * x": lambda m, x: 2 * x,
    "x / 2": lambda m, x: x / 2,
    "x ** 2": lambda m, x: x**2,
    "2 ** x": lambda m, x: 2**x,
    "sum": lambda m, x: x.sum(),
    "sum(0)": lambda m, x: x.sum(0),
    "mean(1)": lambda m, x: x.mean(1),
    "transpose": lambda m, x: x.transpose(0, 1),
    "reshape": lambda m, x: x.reshape(3, 2),
    "clamp": lambda m, x: x.clamp(0, 1),
    "where": lambda m, x: m.where(x > 0, x, 0.0),
    "maximum": lambda m, x: m.maximum(x, m.zeros(2, 3)),
    "select": lambda m, x: x[0],
    "split": lambda m, x: x.split(1)[0],
    "cat": lambda m, x: m.cat([x, x]),
    "gather": lambda m, x: x.gather(1, m.zeros(2, 1, dtype=m.int64)),
    "index_select": lambda m, x: x.index_select(1, m.tensor([0, 2])),
    "softmax": lambda m, x: x.softmax(0),
    "max(0)": lambda m, x: x.max(0)[0],
    "var(0)": lambda m, x: x.var(0),
    "matmul": lambda m, x: x @ m.ones(3, 1),
    "to(float64)": lambda m, x: x.to(m.float64),
}


@pytest.mark.parametrize("op", list(_OPS))
def test_next_functions_one_edge_per_differentiable_input(op: str, th: Any) -> None:
    ours = _edge_kinds(_OPS[op](ag, _ones(ag, 2, 3)).grad_fn)
    assert "AccumulateGrad" in ours
    # Non-tensor arguments (dims, shapes, exponents) and index/mask tensors get no edge.
    assert len(ours) <= 2
    if th is not None:
        assert ours == _edge_kinds(_OPS[op](th, _ones(th, 2, 3)).grad_fn)


def test_custom_function_has_one_edge_per_tensor_argument(lib: Any) -> None:
    mixed = _functions(lib)[4]
    x = _ones(lib, 3)
    index = lib.zeros(3, dtype=lib.int64)
    y = mixed.apply(x, index, 2, lib.ones(3))
    assert _edge_kinds(y.grad_fn) == ["AccumulateGrad", None, None]
    # backward still returns one gradient per forward argument
    _backward(lib, y.sum())
    assert_close(x.grad, np.full(3, 2.0))
    assert y.grad_fn.needs_input_grad == (True, False, False, False)


_REDUCTIONS: dict[str, tuple[Callable[[Any], Any], list[str]]] = {
    # PyTorch's sum_backward: unsqueeze each reduced dimension, then expand.
    "sum": (lambda x: x.sum(), ["ExpandBackward0", "AccumulateGrad"]),
    "sum(1)": (lambda x: x.sum(1), ["ExpandBackward0", "UnsqueezeBackward0", "AccumulateGrad"]),
    "sum((0, 2))": (
        lambda x: x.sum((0, 2)),
        ["ExpandBackward0", "UnsqueezeBackward0", "UnsqueezeBackward0", "AccumulateGrad"],
    ),
    "sum(1, keepdim)": (lambda x: x.sum(1, keepdim=True), ["ExpandBackward0", "AccumulateGrad"]),
}


@pytest.mark.parametrize("reduce", list(_REDUCTIONS))
def test_sum_backward_graph(reduce: str, lib: Any) -> None:
    reduction, expected = _REDUCTIONS[reduce]
    x = _ones(lib, 2, 3, 4)
    out = reduction(x)
    weight = lib.full(tuple(out.shape), 2.0, requires_grad=True)
    (grad,) = _grad(lib, out, x, grad_outputs=weight, create_graph=True)
    assert_close(grad, np.full((2, 3, 4), 2.0))
    assert _graph_names(grad) == expected


def test_create_graph_backward_copies_the_first_gradient(lib: Any) -> None:
    x = _ones(lib, 3)
    y = (x * x).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (tested below: torch warns once per process)
        _backward(lib, y, create_graph=True, retain_graph=True)
        first = x.grad
        _backward(lib, y, create_graph=True)
    product = ["AddBackward0", "MulBackward0", "AccumulateGrad", "MulBackward0", "AccumulateGrad"]
    assert _graph_names(first) == ["CopyBackwards", *product]
    assert _graph_names(x.grad) == ["AddBackward0", "CopyBackwards", *product, *product]
    assert_close(x.grad, np.full(3, 4.0))


def test_once_differentiable_error_node_hangs_off_fresh_leaves(lib: Any) -> None:
    base = lib.Function if lib is ag else lib.autograd.Function
    decorate = (
        ag.once_differentiable
        if lib is ag
        else __import__("torch.autograd.function").autograd.function.once_differentiable
    )

    class Square(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @decorate
        def backward(ctx: Any, grad: Any) -> Any:
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x = _ones(lib, 3)
    weight = _ones(lib, 3)
    incoming = weight * 1
    (gx,) = _grad(lib, Square.apply(x), x, grad_outputs=incoming, create_graph=True)
    assert_close(gx, np.full(3, 2.0))
    assert [name.removeprefix("torch::autograd::") for name in _graph_names(gx)] == [
        "Error",
        "AccumulateGrad",
    ]
    # The incoming gradient's graph is not behind it: w is simply not reached...
    assert _grad(lib, gx.sum(), weight, allow_unused=True) == (None,)
    # ...and reaching the node raises.
    with pytest.raises(RuntimeError, match="once_differentiable"):
        _backward(lib, gx.sum())


# ----------------------------------------------------------------- warnings and validation
async def test_backward_with_create_graph_warns_of_the_reference_cycle() -> None:
    x = _ones(ag, 3)
    with pytest.warns(UserWarning, match="reference cycle between the parameter and its"):
        await (x * x).sum().backward(create_graph=True)
    with pytest.warns(UserWarning, match="reference cycle"):
        await ag.backward((x * x).sum(), create_graph=True, inputs=[x])
    assert_close(x.grad, np.full(3, 4.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # grad() makes no cycle: no warning
        await ag.grad((x * x).sum(), x, create_graph=True)


def test_reading_grad_of_a_non_leaf_warns(lib: Any) -> None:
    x = _ones(lib, 3)
    y = x * 2
    with pytest.warns(UserWarning, match="not a leaf Tensor"):
        assert y.grad is None
    y.retain_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert y.grad is None
        assert x.grad is None


def test_grad_mode_decorating_a_class_warns(lib: Any) -> None:
    with pytest.warns(FutureWarning, match="Decorating classes is deprecated"):

        @lib.no_grad()
        class Model:
            def __init__(self) -> None:
                self.mode = lib.is_grad_enabled()

    assert Model().mode is False
    assert lib.is_grad_enabled()


def test_post_accumulate_grad_hook_must_return_none(lib: Any) -> None:
    x = _ones(lib, 3)
    x.register_post_accumulate_grad_hook(lambda tensor: tensor.grad * 2)
    with pytest.raises(RuntimeError, match="should return None"):
        _backward(lib, (x * 2).sum())
    z = _ones(lib, 3)
    _backward(lib, (z * 2).sum())
    assert_close(z.grad, np.full(3, 2.0))


def test_assigning_a_tensor_as_its_own_grad_raises(lib: Any) -> None:
    x = _ones(lib, 3)
    with pytest.raises(RuntimeError, match="can't assign Variable as its own grad"):
        x.grad = x
    assert x.grad is None


def test_integer_data_in_a_leaf_that_requires_grad_is_reported() -> None:
    # PyTorch refuses the assignment itself; aioautograd's .data is the raw array (see
    # README, "Differences from PyTorch") and reports it when a gradient reaches the leaf.
    x = _ones(ag, 3)
    y = x * 2
    x.data = np.ones(3, dtype=np.int64)
    with pytest.raises(RuntimeError, match=r"cannot have gradients.*\.data"):
        y.sum().backward_sync()


def test_detach_in_place_refuses_views(lib: Any) -> None:
    x = _ones(lib, 3, 2)
    saved_input = (x * 1)[0]
    _ = saved_input.sin()  # saves its input
    views = [saved_input, x.view(6), x.transpose(0, 1)]
    with lib.no_grad():
        views.append(x.view(6))
    for view in views:
        with pytest.raises(RuntimeError, match="Can't detach views in-place"):
            view.detach_()
    y = x * 2
    assert y.detach_() is y
    assert y.is_leaf
    assert not y.requires_grad


def test_grad_through_a_reentrant_checkpoint_raises(th: Any) -> None:
    x = _ones(ag, 3)
    with pytest.raises(RuntimeError, match="checkpoint is incompatible with grad"):
        ag.grad_sync(ag.checkpoint(lambda t: t.sin(), x).sum(), x)
    with pytest.raises(RuntimeError, match="checkpoint is incompatible"):
        ag.checkpoint(lambda t: t.sin(), x).sum().backward_sync(inputs=[x])
    ag.checkpoint(lambda t: t.sin(), x).sum().backward_sync()
    assert_close(x.grad, np.cos(np.ones(3)))
    if th is not None:
        from torch.utils.checkpoint import checkpoint

        tx = _ones(th, 3)
        with pytest.raises(RuntimeError, match=r"incompatible with \.grad"):
            th.autograd.grad(checkpoint(lambda t: t.sin(), tx, use_reentrant=True).sum(), tx)


def test_requires_grad_on_a_non_leaf(lib: Any) -> None:
    x = _ones(lib, 3)
    y = x * 2
    assert y.requires_grad_() is y
    assert y.requires_grad_(True) is y
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf"):
        y.requires_grad_(False)
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf"):
        y.requires_grad = True
