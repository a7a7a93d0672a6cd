"""In-place ops: ``exp_ fill_``, and in-place ops on views (PyTorch's ``CopySlices``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close
from tests.ops.oracle import check_against_torch


def _array(*shape: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal(shape)


def _randn(*shape: int, device: str = "cpu") -> ag.Tensor:
    return ag.randn(*shape, dtype="float64", device=device, requires_grad=True)


# ------------------------------------------------------------------------- exp_ and fill_


async def test_exp_inplace_value_version_and_grad(device: str) -> None:
    x = _randn(2, 3, device=device)
    expected = np.exp(x.detach().cpu().data)
    assert await ag.gradcheck(lambda t: (t * 1).exp_(), (x,))
    y = x * 1
    version = y._version
    assert y.exp_() is y
    assert y._version == version + 1
    assert y.grad_fn.name() == "ExpInplaceBackward0"
    assert_close(y, expected)


async def test_exp_inplace_second_derivative() -> None:
    assert await ag.gradgradcheck(lambda t: (t * 1).exp_(), (_randn(3),))


async def test_fill_with_number_and_with_tensor_value(device: str) -> None:
    x = _randn(2, 3, device=device)
    value = ag.tensor(0.5, dtype="float64", device=device, requires_grad=True)
    assert await ag.gradcheck(lambda t, v: (t * 2).fill_(v) * t, (x, value))
    y = (x * 1).fill_(3)
    assert_close(y, np.full((2, 3), 3.0))
    await (y * 2).sum().backward()
    assert_close(x.grad, np.zeros((2, 3)))


def test_fill_rejects_a_value_with_dimensions() -> None:
    with pytest.raises(RuntimeError, match="0-dimension value"):
        ag.zeros(3).fill_(ag.ones(2))


async def test_exp_and_fill_match_torch(torch: Any) -> None:
    await check_against_torch(
        torch, lambda m, x, v: ((x * 1).exp_() * 2, (x * 1).fill_(v[0])), _array(2, 3), _array(1)
    )


# ------------------------------------------------------------------------------- relu_


async def test_relu_inplace_value_version_and_grad(device: str) -> None:
    x = _randn(3, 4, device=device)
    assert await ag.gradcheck(lambda t: (t * 1).relu_(), (x,))
    y = x * 1
    version = y._version
    assert y.relu_() is y
    assert y._version == version + 1
    assert y.grad_fn.name() == "ReluInplaceBackward0"
    assert_close(y, np.maximum(x.detach().cpu().data, 0))
    # The gradients equal the out-of-place op's, bit for bit (the same derivative code).
    y2 = (x * 1).relu()
    await ((y * y).sum() + y.sum()).backward()
    first = x.grad.detach().cpu().data.copy()
    x.grad = None
    await ((y2 * y2).sum() + y2.sum()).backward()
    np.testing.assert_array_equal(first, x.grad.detach().cpu().data)


async def test_relu_inplace_second_derivative() -> None:
    assert await ag.gradgradcheck(lambda t: (t * 1).relu_() * t, (_randn(4),))


async def test_relu_inplace_of_a_saved_tensor_fails_at_backward() -> None:
    x = _randn(3)
    y = x * 1
    z = y * y  # saves y
    y.relu_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        await z.sum().backward()


def test_relu_inplace_of_a_leaf_that_requires_grad_is_refused() -> None:
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        _randn(3).relu_()


async def test_relu_inplace_functional_and_module_match_torch(torch: Any) -> None:
    await check_against_torch(
        torch,
        lambda m, x: (
            m.nn.functional.relu(x * 1, inplace=True) * 2,
            m.nn.ReLU(inplace=True)(x * 3),
            (x * 1).relu_(),
        ),
        _array(3, 5),
    )
    assert repr(ag.nn.ReLU(inplace=True)) == "ReLU(inplace=True)"
    assert repr(ag.nn.ReLU()) == "ReLU()"


# ------------------------------------------------------------------- in-place on views


async def test_inplace_on_a_view_rebases_view_and_base(torch: Any) -> None:
    data = _array(3, 4)
    a = ag.tensor(data, requires_grad=True)
    b = a.clone()
    view = b[1]
    version = b._version
    view.mul_(2)
    assert b._version == view._version == version + 1
    assert b.grad_fn.name() == "CopySlices"
    assert view.grad_fn.name() == "AsStridedBackward0"
    assert view.grad_fn.next_functions[0][0] is b.grad_fn
    assert b.grad_fn.next_functions[0][0].name() == "CloneBackward0"
    assert not b.is_leaf
    await ((b * b).sum() + (view * 3).sum()).backward()

    ta = torch.tensor(data, requires_grad=True)
    tb = ta.clone()
    tview = tb[1]
    tview.mul_(2)
    assert tb.grad_fn.name().endswith(b.grad_fn.name())
    assert tview.grad_fn.name() == view.grad_fn.name()
    ((tb * tb).sum() + (tview * 3).sum()).backward()
    assert_close(a.grad, ta.grad)


VIEWS = {
    "row": lambda t: t[1],
    "column": lambda t: t[:, 2],
    "strided": lambda t: t[::2, 1::2],
    "transposed": lambda t: t.T[1:],
    "view_of_view": lambda t: t[1:].T[2],
    "reshaped": lambda t: t.reshape(12)[3:9],
    "narrow": lambda t: t.narrow(1, 1, 2),
}


# NumPy's negative strides (PyTorch has none): finite differences only.
REVERSED = {"reversed": lambda t: t[1:][:, ::-1][0], "reversed_base": lambda t: t[::-1][1:]}


@pytest.mark.parametrize(
    "make_view", [*VIEWS.values(), *REVERSED.values()], ids=[*VIEWS.keys(), *REVERSED.keys()]
)
async def test_inplace_on_views_matches_finite_differences(make_view: Any, device: str) -> None:
    x = _randn(3, 4, device=device)
    w = _randn(*make_view(x.detach()).shape, device=device)

    def fn(t: ag.Tensor, other: ag.Tensor) -> ag.Tensor:
        base = t * 1.5
        view = make_view(base)
        view.mul_(other)
        view.add_(t.sum())
        return base * base.sum()

    assert await ag.gradcheck(fn, (x, w))


@pytest.mark.parametrize("make_view", VIEWS.values(), ids=VIEWS.keys())
async def test_inplace_on_views_matches_torch(make_view: Any, torch: Any) -> None:
    shape = make_view(ag.zeros(3, 4)).shape

    def fn(m: Any, t: Any, other: Any) -> Any:
        base = t * 1.5
        view = make_view(base)
        view.mul_(other)
        return base, view * 2

    await check_against_torch(torch, fn, _array(3, 4), _array(*shape, seed=1))


async def test_inplace_through_a_view_makes_a_plain_base_require_grad(torch: Any) -> None:
    w_data = _array(2)
    base = ag.zeros(4, dtype="float64")
    w = ag.tensor(w_data, requires_grad=True)
    base[1:3].copy_(w)
    assert base.requires_grad
    assert base.grad_fn.name() == "CopySlices"
    await (base * ag.arange(4, dtype="float64")).sum().backward()

    tbase = torch.zeros(4, dtype=torch.float64)
    tw = torch.tensor(w_data, requires_grad=True)
    tbase[1:3].copy_(tw)
    (tbase * torch.arange(4, dtype=torch.float64)).sum().backward()
    assert_close(w.grad, tw.grad)


async def test_inplace_on_view_second_derivative() -> None:
    def fn(t: ag.Tensor) -> ag.Tensor:
        base = t * t
        base[0].mul_(t[1])
        base[1].add_(t[0] * t[1])
        return base * base

    assert await ag.gradgradcheck(fn, (_randn(2, 3),))


async def test_mul_inplace_by_a_tensor_second_derivative() -> None:
    # The gradient for ``other`` uses x before the update, with x's history then.
    def fn(t: ag.Tensor) -> ag.Tensor:
        base = t * t
        base.mul_(t)
        return base * base

    assert await ag.gradgradcheck(fn, (_randn(2, 3),))


def test_inplace_on_a_view_of_a_leaf_that_requires_grad_raises(torch: Any) -> None:
    leaf = ag.randn(3, 4, requires_grad=True)
    before = leaf.data.copy()
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
        leaf[0].mul_(2)
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
        leaf.T.add_(1)
    assert_close(leaf.detach(), before)
    tleaf = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
        tleaf[0].mul_(2)
    # Under no_grad it is an ordinary update (as optimizers do it).
    with ag.no_grad():
        leaf[0].mul_(2)
    assert_close(leaf.detach()[0], before[0] * 2)


def test_inplace_on_a_view_made_under_no_grad_raises(torch: Any) -> None:
    for lib in (ag, torch):
        leaf = lib.ones(3, requires_grad=True)
        with lib.no_grad():
            view = leaf[:2]
        with pytest.raises(RuntimeError, match="A view was created in no_grad mode"):
            view.mul_(2)
        nonleaf = leaf * 1
        with lib.no_grad():
            view = nonleaf[:2]
        with pytest.raises(RuntimeError, match="A view was created in no_grad mode"):
            view.add_(1)
    leaf = ag.ones(3, requires_grad=True)
    assert_close(leaf.detach(), np.ones(3))
    with ag.no_grad():
        view = leaf[:2]
        view.mul_(2)  # both in no_grad: allowed
    assert_close(leaf.detach(), [2.0, 2.0, 1.0])


def test_view_of_the_same_shape_is_a_new_view() -> None:
    x = ag.randn(2, 3, requires_grad=True)
    for view in (x.view(x.shape), x.view(2, 3), x.view_as(x)):
        assert view is not x
        assert view._base is x
        assert view._version_counter is x._version_counter
        assert view.grad_fn.name() == "ReshapeBackward0"


async def test_a_view_taken_before_a_sibling_rebase_is_reported_then_retaken(torch: Any) -> None:
    # Both libraries refuse an in-place op on the old view (with different messages); the
    # view taken again gives PyTorch's gradients.
    w_data = _array(2)
    base = ag.zeros(4, dtype="float64")
    stale = base[2:]
    w = ag.tensor(w_data, requires_grad=True)
    base[:2].copy_(w * 3)
    with pytest.raises(RuntimeError, match="take the view again"):
        stale.mul_(2)
    base[2:].add_(w)
    await (base * base).sum().backward()

    tbase = torch.zeros(4, dtype=torch.float64)
    tstale = tbase[2:]
    tw = torch.tensor(w_data, requires_grad=True)
    tbase[:2].copy_(tw * 3)
    with pytest.raises(RuntimeError, match="in-place operation"):
        tstale.mul_(2)
    tbase[2:].add_(tw)
    (tbase * tbase).sum().backward()
    assert_close(w.grad, tw.grad)


async def test_an_update_under_no_grad_bumps_the_version_and_keeps_the_checks(
    device: str,
) -> None:
    # ``p.sub_(p.grad, alpha=lr)`` as optimizers run it: nothing recorded, but the value, the
    # version counter (a saved tensor modified since is caught), the dtype, a view's base
    # and the errors are those of the recorded op.
    p = ag.tensor(_array(3, 4), device=device, requires_grad=True)
    step = ag.tensor(_array(3, 4, seed=1), device=device)
    y = (p * p).sum()  # saves p
    version = p._version
    with ag.no_grad():
        assert p.sub_(step, alpha=0.5) is p
        p[0].add_(step[0])  # through a view: the base's counter
    assert p._version == version + 2
    expected = _array(3, 4) - 0.5 * _array(3, 4, seed=1)
    expected[0] += _array(3, 4, seed=1)[0]
    assert_close(p.detach(), expected.astype(p.data.dtype))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        await y.backward()
    with ag.no_grad(), pytest.raises(RuntimeError, match="cannot be broadcast"):
        p.add_(ag.tensor(_array(2, 4), device=device))
    frozen = ag.tensor(_array(4)).expand(3, 4)
    with ag.no_grad(), pytest.raises(RuntimeError, match="read-only"):
        frozen.add_(ag.tensor(_array(3, 4)), alpha=2.0)
