"""Tensor attributes, factories, conversions and the version counter."""

from __future__ import annotations

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close


def test_factories_default_dtypes_follow_pytorch() -> None:
    assert ag.tensor([1.0, 2.0]).dtype == np.float32
    assert ag.tensor([1, 2]).dtype == np.int64
    assert ag.tensor([True]).dtype == np.bool_
    assert ag.tensor(np.zeros(2, dtype=np.float64)).dtype == np.float64
    assert ag.randn(2, 3).dtype == np.float32
    assert ag.zeros(2, 3).shape == (2, 3)
    assert ag.ones((4,)).shape == (4,)
    assert ag.arange(5).dtype == np.int64
    assert ag.arange(0.0, 1.0, 0.25).shape == (4,)
    assert ag.full((2,), 7.0).tolist() == [7.0, 7.0]
    assert ag.zeros_like(ag.randn(3, dtype="float64")).dtype == np.float64
    assert ag.rand(100).numpy().min() >= 0


def test_tensor_copies_and_from_numpy_shares() -> None:
    array = np.ones(3)
    copied = ag.tensor(array)
    shared = ag.from_numpy(array)
    array[0] = 5
    assert copied.tolist()[0] == 1.0
    assert shared.tolist()[0] == 5.0


def test_dlpack_round_trip() -> None:
    x = ag.randn(3, 2)
    y = ag.from_dlpack(x)
    assert np.shares_memory(x.data, y.data)
    z = np.from_dlpack(x)
    assert_close(z, x)


def test_manual_seed_reproducible() -> None:
    ag.manual_seed(7)
    a = ag.randn(4)
    ag.manual_seed(7)
    b = ag.randn(4)
    assert_close(a, b)


def test_leaf_and_grad_fn_attributes() -> None:
    x = ag.randn(3, requires_grad=True)
    y = x * 2
    assert x.is_leaf
    assert not y.is_leaf
    assert x.grad_fn is None
    assert y.grad_fn.name() == "MulBackward0"
    assert y.requires_grad
    assert y.output_nr == 0
    assert not ag.randn(2).requires_grad


def test_no_grad_produces_leaves() -> None:
    x = ag.randn(3, requires_grad=True)
    with ag.no_grad():
        y = x * 2
    assert y.is_leaf
    assert not y.requires_grad


def test_detach_shares_data_and_version_counter() -> None:
    x = ag.randn(3, requires_grad=True)
    d = x.detach()
    assert not d.requires_grad
    assert np.shares_memory(d.data, x.data)
    d.add_(1)
    assert x._version == 1


def test_detach_in_place() -> None:
    x = ag.randn(3, requires_grad=True)
    y = x * 2
    y.detach_()
    assert y.is_leaf
    assert not y.requires_grad


def test_requires_grad_setter_and_method() -> None:
    x = ag.randn(3)
    assert x.requires_grad_() is x
    assert x.requires_grad
    x.requires_grad = False
    assert not x.requires_grad


def test_item_and_conversions() -> None:
    x = ag.tensor([[2.5]])
    assert x.item() == 2.5
    assert float(x) == 2.5
    with pytest.raises(RuntimeError, match="cannot be converted to Scalar"):
        ag.randn(3).item()
    assert ag.tensor([1.5, 2.5]).double().dtype == np.float64
    assert ag.tensor([1.5, 2.5]).long().tolist() == [1, 2]
    assert len(ag.randn(4, 2)) == 4


async def test_dtype_cast_is_differentiable() -> None:
    x = ag.randn(3, requires_grad=True)
    y = x.double() * 2
    await y.sum().backward()
    assert x.grad is not None
    assert x.grad.dtype == np.float32
    assert_close(x.grad, np.full(3, 2.0))


def test_comparisons_return_boolean_tensors() -> None:
    x = ag.tensor([1.0, 2.0, 3.0], requires_grad=True)
    mask = x > 1.5
    assert mask.dtype == np.bool_
    assert mask.tolist() == [False, True, True]
    assert not mask.requires_grad
    assert (x == 2.0).tolist() == [False, True, False]
    assert hash(x) == id(x) or isinstance(hash(x), int)


def test_repr_mentions_grad_fn_and_requires_grad() -> None:
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    assert "requires_grad=True" in repr(x)
    assert "grad_fn=<MulBackward0>" in repr(x * 2)
    assert repr(ag.tensor([1.0], dtype="float64")).endswith("dtype=float64)")


def test_reverse_operators_with_scalars_and_arrays() -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64")
    assert_close(2 - x, [1.0, 0.0])
    assert_close(1 / x, [1.0, 0.5])
    assert_close(2**x, [2.0, 4.0])
    assert_close(np.array([1.0, 1.0]) + x, [2.0, 3.0])
    assert isinstance(np.array([1.0, 1.0]) + x, ag.Tensor)


def test_device_attributes() -> None:
    x = ag.randn(2)
    assert x.device is ag.device("cpu")
    assert str(x.device) == "cpu"
    assert x.cpu() is x
    with pytest.raises(ValueError, match="unknown device"):
        ag.device("tpu")


def test_deepcopy_of_a_leaf_is_a_fresh_leaf() -> None:
    import copy

    x = ag.randn(3, requires_grad=True)
    x.sum().backward_sync()
    y = copy.deepcopy(x)
    assert y is not x
    assert not np.shares_memory(y.data, x.data)
    assert_close(y.grad, x.grad)
    x.grad = None
    y.sum().backward_sync()
    assert x.grad is None
    assert_close(y.grad, np.full(3, 2.0))
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(x * 2)


class _Tagged(ag.Tensor):
    """A subclass with attributes of its own (as user code may write)."""


def _pickled(tensor: object) -> object:
    import pickle

    return pickle.loads(pickle.dumps(tensor))


def test_pickling_gives_a_fresh_leaf_as_pytorch_does() -> None:
    # A leaf that took part in a backward (its accumulator exists), a non-leaf and a view:
    # each comes back as a leaf with a copy of the data and requires_grad, without history
    # or .grad; torch (where installed) gives the same.
    x = ag.tensor([1.0, -2.0, 3.0], requires_grad=True)
    (x * 2).sum().backward_sync()
    y = x * 2
    view = ag.arange(6.0).reshape(2, 3)[:, 1]
    restored = [_pickled(t) for t in (x, y, view)]
    for original, back in zip((x, y, view), restored, strict=True):
        assert isinstance(back, ag.Tensor)
        assert type(back) is ag.Tensor
        assert back.is_leaf
        assert back.grad_fn is None
        assert back.grad is None
        assert back.requires_grad == original.requires_grad
        assert back.dtype == original.dtype
        assert back.device is original.device
        assert back.tolist() == original.tolist()
        assert not np.shares_memory(back.data, original.data)
    back_x = restored[0]
    assert isinstance(back_x, ag.Tensor)
    (back_x * 3).sum().backward_sync()  # its own accumulator: x's .grad is untouched
    assert_close(back_x.grad, np.full(3, 3.0))
    assert_close(x.grad, np.full(3, 2.0))
    torch = pytest.importorskip("torch")
    tx = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    (tx * 2).sum().backward()
    for t in (tx, tx * 2):
        back_t = _pickled(t)
        assert isinstance(back_t, torch.Tensor)
        assert back_t.is_leaf
        assert back_t.grad is None
        assert back_t.requires_grad


def test_pickling_warns_about_hooks_and_keeps_a_subclass_and_its_attributes() -> None:
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    x.register_hook(lambda grad: grad * 2)
    with pytest.warns(UserWarning, match="hooks .* will not be pickled"):
        back = _pickled(x)
    assert isinstance(back, ag.Tensor)
    assert back._backward_hooks is None
    tagged = _Tagged(np.ones(2, dtype=np.float32), requires_grad=True)
    tagged.name = "w"  # type: ignore[attr-defined]
    restored = _pickled(tagged)
    assert type(restored) is _Tagged
    assert restored.name == "w"  # type: ignore[attr-defined]
    assert restored.requires_grad
    assert restored.is_leaf
