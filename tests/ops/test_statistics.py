"""``var_mean std norm cumsum all any masked_fill``, and the tensor API around them
(``data_ptr``, ``del t.grad``, ``view_as``, ``narrow``)."""

from __future__ import annotations

import math
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


REDUCE_ARGS = [
    {},
    {"dim": 1},
    {"dim": (0, 2), "keepdim": True},
    {"dim": -1, "correction": 0},
]


@pytest.mark.parametrize("kwargs", REDUCE_ARGS, ids=repr)
async def test_var_mean_and_std(kwargs: dict[str, Any], device: str) -> None:
    x = _randn(2, 3, 4, device=device)
    var, mean = ag.var_mean(x, **kwargs)
    assert_close(var, x.var(**kwargs))
    dim = kwargs.get("dim")
    assert_close(mean, x.mean(dim, keepdim=kwargs.get("keepdim", False)))
    assert_close(x.std(**kwargs), np.sqrt(var.detach().cpu().data))
    assert await ag.gradcheck(lambda t: t.var_mean(**kwargs), (x,))
    assert await ag.gradcheck(lambda t: t.std(**kwargs), (x,))


@pytest.mark.parametrize("kwargs", REDUCE_ARGS, ids=repr)
async def test_var_mean_and_std_match_torch(kwargs: dict[str, Any], torch: Any) -> None:
    await check_against_torch(
        torch, lambda m, t: (*m.var_mean(t, **kwargs), t.std(**kwargs)), _array(2, 3, 4)
    )


NORMS = [
    {},
    {"p": 1},
    {"p": 3, "dim": 1},
    {"p": 2, "dim": (0, 1), "keepdim": True},
    {"p": math.inf},
    {"p": math.inf, "dim": 0},
    {"p": 0.5, "dim": -1},
    {"p": "fro", "dim": 1, "keepdim": True},
]


@pytest.mark.parametrize("kwargs", NORMS, ids=repr)
async def test_norm_values_and_gradients(kwargs: dict[str, Any], device: str) -> None:
    x = _randn(3, 4, device=device)
    assert await ag.gradcheck(lambda t: t.norm(**kwargs), (x,))


@pytest.mark.parametrize("kwargs", NORMS, ids=repr)
async def test_norm_matches_torch(kwargs: dict[str, Any], torch: Any) -> None:
    await check_against_torch(torch, lambda m, t: m.norm(t, **kwargs), _array(3, 4))


async def test_norm_second_derivative_and_zero_vector(torch: Any) -> None:
    assert await ag.gradgradcheck(lambda t: t.norm(), (_randn(5),))
    zero = ag.zeros(3, dtype="float64", requires_grad=True)
    await zero.norm().backward()
    tzero = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    tzero.norm().backward()
    assert_close(zero.grad, tzero.grad)  # a subgradient (0), not nan
    with pytest.raises(RuntimeError, match="not supported"):
        ag.ones(2, 2).norm("nuc")


@pytest.mark.parametrize(("shape", "dim"), [((5,), 0), ((3, 4), 1), ((3, 4), -2), ((), 0)])
async def test_cumsum(shape: tuple[int, ...], dim: int, device: str) -> None:
    x = _randn(*shape, device=device)
    expected = np.cumsum(x.detach().cpu().data, axis=dim) if shape else x.detach().cpu().data
    assert_close(x.cumsum(dim), expected)
    assert await ag.gradcheck(lambda t: t.cumsum(dim), (x,))
    assert await ag.gradgradcheck(lambda t: t.cumsum(dim) ** 2, (x,))


async def test_cumsum_matches_torch(torch: Any) -> None:
    await check_against_torch(torch, lambda m, t: (t.cumsum(1), m.cumsum(t, 0)), _array(3, 4))
    assert ag.cumsum(ag.tensor([1, 2, 3], dtype="int32"), 0).dtype == np.int64


def test_all_and_any(torch: Any) -> None:
    data = np.array([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    for lib in (ag, torch):
        x = lib.tensor(data, requires_grad=True)
        assert not bool(x.all())
        assert bool(x.any())
        assert x.all(dim=1).tolist() == [False, True]
        assert x.any(dim=0, keepdim=True).tolist() == [[True, True, True]]
        assert lib.all(x > -1).tolist() is True
        assert not lib.any(x < 0).requires_grad


async def test_masked_fill(device: str, torch: Any) -> None:
    mask_data = np.array([[True, False, True, False]])
    x = _randn(3, 4, device=device)
    mask = ag.tensor(mask_data, device=device)
    value = ag.tensor(0.25, dtype="float64", device=device, requires_grad=True)
    assert await ag.gradcheck(lambda t, v: t.masked_fill(mask, v) * t, (x, value))
    assert await ag.gradcheck(lambda t: ag.masked_fill(t, mask, -1.5), (x,))
    await check_against_torch(
        torch,
        lambda m, t, v: t.masked_fill(m.tensor(mask_data), v[0]) * t,
        _array(3, 4),
        _array(1),
    )
    with pytest.raises(RuntimeError, match="boolean masks"):
        x.masked_fill(ag.tensor([1, 0, 1, 0]), 0.0)


def test_data_ptr_follows_views() -> None:
    x = ag.zeros(3, 4)
    assert x.data_ptr() == x.data.ctypes.data
    assert x[1].data_ptr() == x.data_ptr() + 4 * x.dtype.itemsize
    assert x.view(12).data_ptr() == x.data_ptr()
    assert x.clone().data_ptr() != x.data_ptr()


async def test_del_grad_resets_it() -> None:
    x = ag.ones(2, requires_grad=True)
    await (x * 2).sum().backward()
    assert x.grad is not None
    del x.grad
    assert x.grad is None
    await (x * 3).sum().backward()
    assert_close(x.grad, [3.0, 3.0])


async def test_view_as_and_narrow(device: str, torch: Any) -> None:
    x = _randn(3, 4, device=device)
    other = ag.zeros(2, 6)
    assert x.view_as(other).shape == (2, 6)
    narrowed = x.narrow(1, -3, 2)
    assert narrowed._base is x
    assert_close(narrowed, x.detach().cpu().data[:, 1:3])
    assert await ag.gradcheck(lambda t: ag.narrow(t, 0, 1, 2) * 2, (x,))
    await check_against_torch(
        torch, lambda m, t: (t.narrow(0, 1, 2), t.view_as(t.T.reshape(4, 3))), _array(3, 4)
    )
    with pytest.raises(RuntimeError, match="exceeds dimension size"):
        x.narrow(1, 3, 2)
    with pytest.raises(IndexError, match="start out of range"):
        x.narrow(0, 4, 0)
