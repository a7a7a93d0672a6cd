"""Bad input gets a clear error, loses nothing, and leaves the engine usable."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close


class Boom(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


class WrongShape(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return ag.ones(7)


class WrongCount(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


class IntGrad(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return ag.tensor(np.ones(grad.shape, dtype=np.int64))


async def test_non_scalar_without_gradient() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
        await (x * 2).backward()


async def test_root_that_does_not_require_grad() -> None:
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        await ag.randn(3).sum().backward()


async def test_gradient_shape_mismatch() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"Mismatch in shape: grad_output\[0\]") as info:
        await (x * 2).backward(ag.ones(4))
    # The message says what to pass instead.
    assert "Pass a gradient of the output's shape" in str(info.value)
    assert "aioautograd.ones(3,)" in str(info.value)
    assert "output.sum()" in str(info.value)
    await (x * 2).backward(ag.ones(3))  # the engine keeps working
    assert x.grad is not None


async def test_gradient_dtype_mismatch() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="Mismatch in dtype"):
        await (x * 2).backward(ag.tensor([1, 2, 3]))


async def test_gradient_that_is_not_a_tensor() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="gradients must be Tensors"):
        await (x * 2).backward(np.ones(3))  # type: ignore[arg-type]


def test_cuda_without_cupy_or_gpu_says_how_to_fix() -> None:
    from aioautograd.devices import cuda

    if not cuda.is_available():
        with pytest.raises(RuntimeError, match=r"aioautograd\[cuda\]|no GPU is visible"):
            ag.randn(3, device="cuda")
        return
    # A GPU is visible here: hide it from a fresh interpreter, which must then say so.
    code = (
        "import aioautograd as ag\n"
        "try:\n"
        "    ag.randn(3, device='cuda')\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert "no GPU is visible" in result.stdout, result.stdout + result.stderr


async def test_node_error_keeps_type_and_names_the_node() -> None:
    x = ag.randn(3, requires_grad=True)
    y = Boom.apply(x * 2)
    with pytest.raises(ValueError, match="boom in backward") as info:
        await y.sum().backward()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "BoomBackward" in notes
    assert "graph task" in notes
    assert "float32 tensor of shape (3,)" in notes
    assert x.grad is None


async def test_invalid_gradient_shape_from_node() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="returned an invalid gradient at index 0"):
        await WrongShape.apply(x).sum().backward()


async def test_wrong_number_of_gradients() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="incorrect number of gradients"):
        await WrongCount.apply(x).sum().backward()


async def test_integer_gradient_from_node_rejected() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="floating point gradient"):
        await IntGrad.apply(x).sum().backward()


async def test_inplace_modification_of_saved_tensor() -> None:
    x = ag.randn(3, requires_grad=True)
    h = x * 1
    y = h.exp()  # saves its output y
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        await y.sum().backward()
    assert "ExpBackward0" in str(info.value)
    assert "is at version 1; expected version 0" in str(info.value)


async def test_inplace_modification_of_saved_input() -> None:
    x = ag.randn(3, requires_grad=True)
    w = ag.randn(3)
    y = x * w  # saves w
    w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        await y.sum().backward()


async def test_inplace_on_leaf_requiring_grad_rejected_and_data_kept() -> None:
    x = ag.randn(3, requires_grad=True)
    before = x.data.copy()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x.add_(1)
    assert_close(x, before)
    with ag.no_grad():
        x.add_(1)
    assert_close(x, before + 1)
    assert x._version == 1


async def test_inplace_on_non_leaf_rebases_history(torch: object) -> None:
    import torch as th

    data = np.array([0.5, -1.0, 2.0])
    x = ag.tensor(data, requires_grad=True)
    y = x * 2
    y.mul_(x)
    y.add_(3)
    await y.sum().backward()
    tx = th.tensor(data, requires_grad=True)
    ty = tx * 2
    ty.mul_(tx)
    ty.add_(3)
    ty.sum().backward()
    assert y.grad_fn.name() == "AddInplaceBackward0"
    assert_close(x.grad, tx.grad)


async def test_error_in_one_graph_task_does_not_disturb_others() -> None:
    good_inputs = [ag.randn(4, dtype="float64", requires_grad=True) for _ in range(20)]

    async def good(x: ag.Tensor) -> None:
        await (x.exp() * 2).sum().backward()

    async def bad() -> None:
        await Boom.apply(ag.randn(3, requires_grad=True)).sum().backward()

    results = await asyncio.gather(*(good(x) for x in good_inputs), bad(), return_exceptions=True)
    assert isinstance(results[-1], ValueError)
    assert all(r is None for r in results[:-1])
    for x in good_inputs:
        assert_close(x.grad, 2 * np.exp(x.data))
    y = ag.randn(2, requires_grad=True)
    await (y * 3).sum().backward()  # the engine is still usable
    assert_close(y.grad, np.full(2, 3.0))


async def test_requires_grad_on_integer_tensor_rejected() -> None:
    with pytest.raises(RuntimeError, match="floating point"):
        ag.tensor([1, 2, 3], requires_grad=True)


async def test_requires_grad_on_non_leaf_rejected() -> None:
    x = ag.randn(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf variables"):
        (x * 2).requires_grad = False


async def test_numpy_on_tensor_requiring_grad() -> None:
    with pytest.raises(RuntimeError, match=r"detach\(\).numpy\(\)"):
        ag.randn(2, requires_grad=True).numpy()


async def test_assigning_grad_of_wrong_shape() -> None:
    x = ag.randn(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="different size"):
        x.grad = ag.randn(3)


class RaisesBaseException(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        raise SystemExit("exit from a backward")


async def test_base_exception_in_a_node_reaches_the_caller_and_workers_survive() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(SystemExit, match="exit from a backward"):
        await RaisesBaseException.apply(x).sum().backward()
    executor = ag.get_default_engine().executor(ag.device("cpu"))
    assert all(thread.is_alive() for thread in executor._threads)
    results = await asyncio.gather(
        *(((ag.randn(2, requires_grad=True)) * 2).sum().backward() for _ in range(10))
    )
    assert results == [None] * 10
