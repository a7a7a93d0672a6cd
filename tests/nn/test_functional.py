"""Tests of aioautograd.nn.functional: values and gradients against torch.nn.functional,
finite differences (gradcheck, gradgradcheck), argument validation and dropout statistics."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
import aioautograd.nn.functional as F
from aioautograd.ops.conv import Col2Im, ConvGeometry, Im2Col
from aioautograd.ops.embedding import EmbeddingBackward
from tests.helpers import assert_close, to_numpy


def randn(*shape: int) -> np.ndarray[Any, Any]:
    # NumPy's global generator: tests/conftest.py seeds it before every test.
    return np.random.standard_normal(shape)


def leaf(array: Any, device: str = "cpu", requires_grad: bool = True) -> ag.Tensor:
    array = np.asarray(array)
    return ag.tensor(array, device=device, requires_grad=requires_grad and array.dtype.kind == "f")


async def compare_with_torch(
    torch: Any,
    device: str,
    ours: Callable[..., ag.Tensor],
    theirs: Callable[..., Any],
    arrays: Sequence[Any],
    rtol: float = 1e-7,
    atol: float = 1e-10,
) -> None:
    """Run ``ours`` and ``theirs`` on the same arrays (float ones require grad); compare the
    outputs and, for one random output gradient, the gradients of every float input."""
    arrays = [np.asarray(a) for a in arrays]
    our_inputs = [leaf(a, device) for a in arrays]
    their_inputs = [torch.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    out = ours(*our_inputs)
    expected = theirs(*their_inputs)
    assert tuple(out.shape) == tuple(expected.shape)
    assert_close(out, expected, rtol=rtol, atol=atol)
    seed = np.random.standard_normal(tuple(expected.shape))
    await out.backward(ag.tensor(seed, dtype="float64", device=device))
    expected.backward(torch.tensor(seed))
    for mine, reference in zip(our_inputs, their_inputs, strict=True):
        if reference.requires_grad:
            assert mine.grad is not None
            assert_close(mine.grad, reference.grad, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------ linear
@pytest.mark.parametrize("input_shape", [(4,), (3, 4), (2, 3, 4)])
@pytest.mark.parametrize("with_bias", [True, False])
async def test_linear_matches_torch(
    torch: Any, device: str, input_shape: tuple[int, ...], with_bias: bool
) -> None:
    arrays = [randn(*input_shape), randn(5, 4)] + ([randn(5)] if with_bias else [])
    await compare_with_torch(torch, device, F.linear, torch.nn.functional.linear, arrays)


async def test_linear_gradcheck_and_gradgradcheck() -> None:
    args = (leaf(randn(2, 3)), leaf(randn(2, 3)), leaf(randn(2)))
    assert await ag.gradcheck(F.linear, args)
    assert await ag.gradgradcheck(F.linear, args)


def test_linear_shape_mismatch_names_the_shapes() -> None:
    with pytest.raises(RuntimeError, match=r"cannot be multiplied \(6x3 and 4x5\)"):
        F.linear(leaf(randn(2, 3, 3)), leaf(randn(5, 4)))


# ---------------------------------------------------------------------- activations
async def test_relu_matches_torch(torch: Any, device: str) -> None:
    x = randn(3, 4)
    x[np.abs(x) < 1e-3] = 0.5  # keep away from the kink
    await compare_with_torch(torch, device, F.relu, torch.nn.functional.relu, [x])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
async def test_gelu_matches_torch(torch: Any, device: str, approximate: str) -> None:
    await compare_with_torch(
        torch,
        device,
        lambda x: F.gelu(x, approximate=approximate),
        lambda x: torch.nn.functional.gelu(x, approximate=approximate),
        [randn(3, 4)],
    )


@pytest.mark.parametrize("approximate", ["none", "tanh"])
async def test_gelu_gradcheck(approximate: str) -> None:
    x = leaf(randn(2, 3))
    assert await ag.gradcheck(lambda t: F.gelu(t, approximate=approximate), (x,))


def test_gelu_rejects_unknown_approximation() -> None:
    with pytest.raises(ValueError, match="approximate"):
        F.gelu(leaf(randn(2)), approximate="erf")


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [0, 1, -1])
async def test_softmax_family_matches_torch(torch: Any, device: str, name: str, dim: int) -> None:
    await compare_with_torch(
        torch,
        device,
        lambda x: getattr(F, name)(x, dim),
        lambda x: getattr(torch.nn.functional, name)(x, dim),
        [randn(2, 3, 4) * 3],
    )


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
async def test_softmax_family_gradcheck_and_gradgradcheck(name: str) -> None:
    x = leaf(randn(2, 3))
    fn = getattr(F, name)
    assert await ag.gradcheck(lambda t: fn(t, 1), (x,))
    assert await ag.gradgradcheck(lambda t: fn(t, 1), (x,))


def test_softmax_implicit_dim_warns_and_uses_pytorch_choice() -> None:
    x = leaf(randn(2, 3), requires_grad=False)
    with pytest.warns(UserWarning, match="Implicit dimension choice for softmax"):
        out = F.softmax(x)
    np.testing.assert_allclose(to_numpy(out).sum(axis=1), np.ones(2))


def test_softmax_dtype_casts_first() -> None:
    out = F.log_softmax(
        leaf(randn(2, 3).astype(np.float32), requires_grad=False), 1, dtype="float64"
    )
    assert out.dtype == np.float64


# ---------------------------------------------------------------------- cross_entropy
SHAPES = [(5,), (4, 5), (2, 5, 2, 3)]


def _class_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[1:] if len(shape) == 1 else shape[:1] + shape[2:]


def _class_targets(shape: tuple[int, ...], ignore_index: int) -> np.ndarray[Any, Any]:
    num_classes = shape[0] if len(shape) == 1 else shape[1]
    target = np.random.randint(0, num_classes, _class_shape(shape))
    flat = target.reshape(-1)
    if flat.size > 1:
        flat[0] = ignore_index  # at least one ignored position (ignore_index may be a class)
    return target


def _probability_targets(shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    dim = 0 if len(shape) == 1 else 1
    logits = randn(*shape)
    return np.exp(logits) / np.exp(logits).sum(axis=dim, keepdims=True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.25])
@pytest.mark.parametrize("ignore_index", [-100, 2])
async def test_cross_entropy_class_indices_match_torch(
    torch: Any,
    device: str,
    shape: tuple[int, ...],
    reduction: str,
    weighted: bool,
    label_smoothing: float,
    ignore_index: int,
) -> None:
    num_classes = shape[0] if len(shape) == 1 else shape[1]
    target = _class_targets(shape, ignore_index)
    weight = np.random.random(num_classes) + 0.5 if weighted else None
    kwargs = {"ignore_index": ignore_index, "reduction": reduction}
    kwargs["label_smoothing"] = label_smoothing

    def ours(x: ag.Tensor, t: ag.Tensor) -> ag.Tensor:
        w = None if weight is None else ag.tensor(weight, device=device)
        return F.cross_entropy(x, t, w, **kwargs)

    def theirs(x: Any, t: Any) -> Any:
        w = None if weight is None else torch.tensor(weight)
        return torch.nn.functional.cross_entropy(x, t, w, **kwargs)

    await compare_with_torch(torch, device, ours, theirs, [randn(*shape) * 2, target])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.25])
async def test_cross_entropy_probabilities_match_torch(
    torch: Any,
    device: str,
    shape: tuple[int, ...],
    reduction: str,
    weighted: bool,
    label_smoothing: float,
) -> None:
    num_classes = shape[0] if len(shape) == 1 else shape[1]
    weight = np.random.random(num_classes) + 0.5 if weighted else None
    kwargs = {"reduction": reduction, "label_smoothing": label_smoothing}

    def ours(x: ag.Tensor, t: ag.Tensor) -> ag.Tensor:
        w = None if weight is None else ag.tensor(weight, device=device)
        return F.cross_entropy(x, t, w, **kwargs)

    def theirs(x: Any, t: Any) -> Any:
        w = None if weight is None else torch.tensor(weight)
        return torch.nn.functional.cross_entropy(x, t, w, **kwargs)

    # Both the logits and the target probabilities require grad.
    arrays = [randn(*shape) * 2, _probability_targets(shape)]
    await compare_with_torch(torch, device, ours, theirs, arrays)


# Every target a class in range, none ignored, no weight or smoothing: the common case,
# which the op computes without per-position weights (``loss._plain_targets``).
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_cross_entropy_with_every_target_a_class_matches_torch(
    torch: Any, device: str, reduction: str
) -> None:
    target = np.array([0, 4, 2, 4, 1, 3])

    def ours(x: ag.Tensor, t: ag.Tensor) -> ag.Tensor:
        return F.cross_entropy(x, t, reduction=reduction)

    def theirs(x: Any, t: Any) -> Any:
        return torch.nn.functional.cross_entropy(x, t, reduction=reduction)

    await compare_with_torch(torch, device, ours, theirs, [randn(6, 5) * 2, target])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_cross_entropy_with_every_target_a_class_gradcheck(reduction: str) -> None:
    target = ag.tensor(np.array([1, 0, 2, 2]))

    def loss(x: ag.Tensor) -> ag.Tensor:
        return F.cross_entropy(x, target, reduction=reduction)

    assert await ag.gradcheck(loss, (leaf(randn(4, 3)),))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_cross_entropy_common_case_is_bitwise_the_general_formula(
    dtype: str, reduction: str
) -> None:
    # ignore_index=7 names no class of 5 (nothing is ignored) but takes the general path
    # (an ignore_index >= 0 could be a class): same loss and gradient, bit for bit.
    logits = (randn(8, 5) * 3).astype(dtype)
    target = ag.tensor(np.array([0, 4, 2, 4, 1, 3, 3, 0]))
    results = []
    for ignore_index in (-100, 7):
        x = ag.tensor(logits, requires_grad=True)
        loss = F.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction)
        await loss.sum().backward()
        assert x.grad is not None
        results.append((loss.data, x.grad.data))
    (loss_a, grad_a), (loss_b, grad_b) = results
    assert loss_a.dtype == loss_b.dtype == np.dtype(dtype)
    assert loss_a.tobytes() == loss_b.tobytes()
    assert grad_a.tobytes() == grad_b.tobytes()


@pytest.mark.parametrize("target", [[0, -1, 2], [0, -100, 5], [3, 0, 1]])
def test_cross_entropy_rejects_a_target_out_of_range_without_ignored_positions(
    target: list[int],
) -> None:
    # A negative index would silently wrap around in NumPy's gather: it must raise.
    x = leaf(randn(3, 3))
    with pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(x, ag.tensor(np.array(target)))


@pytest.mark.parametrize("on_sim", ["input", "target", "weight"])
def test_cross_entropy_names_the_devices_of_mismatched_tensors(on_sim: str) -> None:
    tensors = {
        "input": leaf(randn(3, 3)),
        "target": ag.tensor([0, 2, 1]),
        "weight": ag.tensor([0.5, 1.0, 2.0], dtype="float64"),
    }
    tensors[on_sim] = tensors[on_sim].to("sim:0")
    with pytest.raises(RuntimeError, match=r"cross_entropy: expected all tensors to be on the"):
        F.cross_entropy(tensors["input"], tensors["target"], tensors["weight"])


def _tiny_class_case() -> tuple[ag.Tensor, ag.Tensor, ag.Tensor]:
    x = leaf(randn(3, 3))
    target = ag.tensor([0, 2, 1])
    weight = ag.tensor([0.5, 1.0, 2.0], dtype="float64")
    return x, target, weight


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("ignore_index", "label_smoothing"), [(-100, 0.0), (2, 0.3)])
async def test_cross_entropy_class_indices_gradcheck_and_gradgradcheck(
    reduction: str, ignore_index: int, label_smoothing: float
) -> None:
    x, target, weight = _tiny_class_case()

    def fn(t: ag.Tensor) -> ag.Tensor:
        return F.cross_entropy(
            t,
            target,
            weight,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
        )

    assert await ag.gradcheck(fn, (x,))
    assert await ag.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
async def test_cross_entropy_probabilities_gradcheck_and_gradgradcheck(
    reduction: str, label_smoothing: float
) -> None:
    x = leaf(randn(2, 3))
    target = leaf(_probability_targets((2, 3)))
    weight = ag.tensor([0.5, 1.0, 2.0], dtype="float64")

    def fn(logits: ag.Tensor, probabilities: ag.Tensor) -> ag.Tensor:
        return F.cross_entropy(
            logits, probabilities, weight, reduction=reduction, label_smoothing=label_smoothing
        )

    assert await ag.gradcheck(fn, (x, target))
    assert await ag.gradgradcheck(fn, (x, target))


async def test_cross_entropy_spatial_gradgradcheck() -> None:
    x = leaf(randn(1, 3, 2))
    target = ag.tensor([[2, 0]])
    assert await ag.gradgradcheck(lambda t: F.cross_entropy(t, target, label_smoothing=0.1), (x,))


async def test_cross_entropy_is_stable_for_huge_logits(torch: Any) -> None:
    logits = np.array([[1e4, -1e4, 0.0], [-5e3, 5e3, 5e3]])
    x = leaf(logits)
    loss = F.cross_entropy(x, ag.tensor([1, 2]))
    await loss.backward()
    reference = torch.tensor(logits, requires_grad=True)
    expected = torch.nn.functional.cross_entropy(reference, torch.tensor([1, 2]))
    expected.backward()
    assert np.isfinite(loss.item())
    assert_close(loss, expected)
    assert_close(x.grad, reference.grad)


async def test_cross_entropy_all_ignored_mean_is_nan_like_torch(torch: Any) -> None:
    x = leaf(randn(2, 3))
    loss = F.cross_entropy(x, ag.tensor([-100, -100]))
    expected = torch.nn.functional.cross_entropy(
        torch.tensor(randn(2, 3)), torch.tensor([-100, -100])
    )
    assert np.isnan(loss.item())
    assert bool(torch.isnan(expected))
    total = F.cross_entropy(x, ag.tensor([-100, -100]), reduction="sum")
    await total.backward()
    np.testing.assert_array_equal(to_numpy(x.grad), np.zeros((2, 3)))
    # The mean's gradient is 0 too (not 0 * 1/0), as torch's.
    x.grad = None
    await loss.backward()
    reference = torch.tensor(randn(2, 3), requires_grad=True)
    torch.nn.functional.cross_entropy(reference, torch.tensor([-100, -100])).backward()
    np.testing.assert_array_equal(to_numpy(x.grad), reference.grad.numpy())
    np.testing.assert_array_equal(to_numpy(x.grad), np.zeros((2, 3)))


async def test_cross_entropy_first_order_path_matches_create_graph_path() -> None:
    x, target, weight = _tiny_class_case()
    loss = F.cross_entropy(x, target, weight, label_smoothing=0.1)
    (plain,) = await ag.grad(loss, x, retain_graph=True)
    (recorded,) = await ag.grad(loss, x, create_graph=True)
    assert not plain.requires_grad
    assert recorded.requires_grad
    assert_close(plain, recorded, rtol=1e-12, atol=1e-15)


async def test_cross_entropy_checks_saved_input_version() -> None:
    x = leaf(randn(2, 3))
    logits = x * 1.0
    loss = F.cross_entropy(logits, ag.tensor([0, 1]))
    assert loss.grad_fn is not None
    assert loss.grad_fn.name() == "CrossEntropyBackward0"
    logits.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        await loss.backward()


@pytest.mark.parametrize(
    ("target", "weight", "kwargs", "error", "match"),
    [
        (ag.tensor([0, 5]), None, {}, IndexError, "Target 5 is out of bounds"),
        (ag.tensor([0, -1]), None, {}, IndexError, "Target -1 is out of bounds"),
        (ag.tensor([0, 1, 2]), None, {}, RuntimeError, r"size \[2\].*got target of size \[3\]"),
        (ag.tensor(np.ones((2, 4))), None, {}, RuntimeError, r"size \[2, 3\].*size \[2, 4\]"),
        (ag.tensor([True, False]), None, {}, RuntimeError, "class indices"),
        (ag.tensor([0, 1]), ag.ones(4, dtype="float64"), {}, RuntimeError, "all 3 classes"),
        (ag.tensor([0, 1]), None, {"reduction": "avg"}, ValueError, "avg is not a valid"),
        (ag.tensor([0, 1]), None, {"label_smoothing": 1.5}, ValueError, "label_smoothing"),
    ],
)
def test_cross_entropy_validates_arguments(
    target: ag.Tensor,
    weight: ag.Tensor | None,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        F.cross_entropy(leaf(randn(2, 3)), target, weight, **kwargs)


async def test_cross_entropy_out_of_range_target_gives_nan_on_an_accelerator(
    device: str,
) -> None:
    # Checking the range would block the host until the device caught up: on an
    # accelerator the offending rows give NaN losses and gradients instead of IndexError.
    if device == "cpu":
        pytest.skip("the CPU raises IndexError (test_cross_entropy_validates_arguments)")
    x = leaf(randn(3, 4), device)
    target = ag.tensor([0, 7, 1], device=device)
    assert np.isnan(F.cross_entropy(x, target).item())
    loss = F.cross_entropy(x, target, reduction="sum")
    assert np.isnan(loss.item())
    await loss.backward()
    grad = to_numpy(x.grad)
    assert np.isnan(grad[1]).all()
    assert np.isfinite(grad[[0, 2]]).all()


def test_cross_entropy_rejects_weight_requiring_grad() -> None:
    weight = leaf(np.ones(3))
    with pytest.raises(RuntimeError, match="derivative for 'weight' is not implemented"):
        F.cross_entropy(leaf(randn(2, 3)), ag.tensor([0, 1]), weight)


# ---------------------------------------------------------------------------- mse_loss
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_mse_loss_matches_torch(torch: Any, device: str, reduction: str) -> None:
    await compare_with_torch(
        torch,
        device,
        lambda a, b: F.mse_loss(a, b, reduction=reduction),
        lambda a, b: torch.nn.functional.mse_loss(a, b, reduction=reduction),
        [randn(3, 4), randn(3, 4)],
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_mse_loss_gradcheck_and_gradgradcheck(reduction: str) -> None:
    args = (leaf(randn(2, 3)), leaf(randn(2, 3)))
    assert await ag.gradcheck(lambda a, b: F.mse_loss(a, b, reduction=reduction), args)
    assert await ag.gradgradcheck(lambda a, b: F.mse_loss(a, b, reduction=reduction), args)


async def test_mse_loss_broadcasting_warns_like_torch(torch: Any) -> None:
    a, b = randn(3, 4), randn(4)
    with pytest.warns(UserWarning, match="different to the input size"):
        out = F.mse_loss(leaf(a), leaf(b))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.nn.functional.mse_loss(torch.tensor(a), torch.tensor(b))
    assert_close(out, expected)


def test_mse_loss_rejects_incompatible_shapes() -> None:
    with pytest.raises(RuntimeError, match=r"\(3, 4\).*\(3,\)"):
        F.mse_loss(leaf(randn(3, 4)), leaf(randn(3)))
    with pytest.raises(ValueError, match="not a valid value for reduction"):
        F.mse_loss(leaf(randn(3)), leaf(randn(3)), reduction="mean_sum")


# ----------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_dropout_validates_p(p: float) -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.dropout(leaf(randn(3)), p)


def test_dropout_is_identity_when_not_training_or_p_zero() -> None:
    x = leaf(randn(4, 5))
    assert F.dropout(x, 0.5, training=False) is x
    assert F.dropout(x, 0.0) is x


async def test_dropout_p_one_zeroes_output_and_gradient(device: str) -> None:
    x = leaf(randn(4, 5), device)
    out = F.dropout(x, 1.0)
    await out.sum().backward()
    np.testing.assert_array_equal(to_numpy(out), np.zeros((4, 5)))
    np.testing.assert_array_equal(to_numpy(x.grad), np.zeros((4, 5)))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_statistics(device: str, p: float) -> None:
    x = ag.ones(200_000, dtype="float64", device=device)
    out = to_numpy(F.dropout(x, p))
    assert abs((out == 0).mean() - p) < 0.01
    assert abs(out.mean() - 1.0) < 0.03
    np.testing.assert_allclose(out[out != 0], 1.0 / (1.0 - p))


async def test_dropout_gradient_is_mask_over_keep_probability(device: str) -> None:
    p = 0.3
    x = leaf(randn(50, 40) + 5.0, device)  # no exact zeros in the input
    out = F.dropout(x, p)
    await out.sum().backward()
    kept = to_numpy(out) != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(to_numpy(x.grad), kept / (1.0 - p))


def test_dropout_is_reproducible_with_manual_seed() -> None:
    x = ag.ones(100, dtype="float64")
    ag.manual_seed(7)
    first = to_numpy(F.dropout(x, 0.5))
    ag.manual_seed(7)
    second = to_numpy(F.dropout(x, 0.5))
    third = to_numpy(F.dropout(x, 0.5))
    np.testing.assert_array_equal(first, second)
    assert not np.array_equal(second, third)


# --------------------------------------------------------------------------- embedding
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
@pytest.mark.parametrize("index_shape", [(7,), (2, 4)])
async def test_embedding_matches_torch(
    torch: Any, device: str, padding_idx: int | None, index_shape: tuple[int, ...]
) -> None:
    indices = np.random.randint(0, 6, index_shape)
    flat = indices.reshape(-1)
    flat[:3] = [1, 1, 5]  # repeated indices, and the padding row for padding_idx=-1
    flat[3] = 2
    await compare_with_torch(
        torch,
        device,
        lambda i, w: F.embedding(i, w, padding_idx),
        lambda i, w: torch.nn.functional.embedding(i, w, padding_idx),
        [indices, randn(6, 3)],
    )


async def test_embedding_gradient_accumulates_and_skips_padding() -> None:
    weight = leaf(randn(4, 2))
    out = F.embedding(ag.tensor([[1, 1], [3, 0]]), weight, padding_idx=0)
    np.testing.assert_array_equal(to_numpy(out)[1, 1], to_numpy(weight.detach())[0])
    await out.sum().backward()
    np.testing.assert_array_equal(to_numpy(weight.grad), [[0, 0], [2, 2], [0, 0], [1, 1]])


async def test_embedding_gradcheck() -> None:
    weight = leaf(randn(4, 2))
    indices = ag.tensor([[0, 3, 3], [1, 2, 0]])
    assert await ag.gradcheck(lambda w: F.embedding(indices, w), (weight,))


@pytest.mark.parametrize("padding_idx", [None, 1])
async def test_embedding_backward_op_is_differentiable(padding_idx: int | None) -> None:
    indices = ag.tensor([1, 3, 1, 0])
    grad = leaf(randn(4, 2))

    def scatter(g: ag.Tensor) -> ag.Tensor:
        return EmbeddingBackward.apply(g, indices, 5, padding_idx)  # type: ignore[no-any-return]

    assert await ag.gradcheck(scatter, (grad,))
    assert await ag.gradgradcheck(scatter, (grad,))


async def test_embedding_double_backward_matches_torch(torch: Any) -> None:
    indices, weights, seed = np.array([2, 0, 2, 1]), randn(3, 2), randn(4, 2)
    ours_seed = leaf(seed)
    weight = leaf(weights)
    out = F.embedding(ag.tensor(indices), weight, padding_idx=0)
    (grad_weight,) = await ag.grad(out, weight, ours_seed, create_graph=True)
    (second,) = await ag.grad((grad_weight * grad_weight).sum(), ours_seed)

    their_seed = torch.tensor(seed, requires_grad=True)
    their_weight = torch.tensor(weights, requires_grad=True)
    their_out = torch.nn.functional.embedding(torch.tensor(indices), their_weight, padding_idx=0)
    (their_grad_weight,) = torch.autograd.grad(
        their_out, their_weight, their_seed, create_graph=True
    )
    (their_second,) = torch.autograd.grad((their_grad_weight**2).sum(), their_seed)
    assert_close(grad_weight, their_grad_weight)
    assert_close(second, their_second)


@pytest.mark.parametrize(
    ("indices", "weight_shape", "padding_idx", "error", "match"),
    [
        (ag.tensor([0, 4]), (4, 2), None, IndexError, "index out of range"),
        (ag.tensor([-1]), (4, 2), None, IndexError, "index out of range"),
        (ag.tensor([0.0]), (4, 2), None, RuntimeError, "integer dtype"),
        (ag.tensor([0]), (4,), None, RuntimeError, "must be 2-D"),
        (ag.tensor([0]), (4, 2), 4, ValueError, "padding_idx must be within"),
        (ag.tensor([0]), (4, 2), -5, ValueError, "padding_idx must be within"),
    ],
)
def test_embedding_validates_arguments(
    indices: ag.Tensor,
    weight_shape: tuple[int, ...],
    padding_idx: int | None,
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        F.embedding(indices, leaf(randn(*weight_shape)), padding_idx)


# -------------------------------------------------------------------------- layer_norm
@pytest.mark.parametrize("normalized_shape", [4, (3, 4)])
@pytest.mark.parametrize("affine", [True, False])
async def test_layer_norm_matches_torch(
    torch: Any, device: str, normalized_shape: int | tuple[int, ...], affine: bool
) -> None:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    arrays = [randn(2, 3, 4) * 3 + 1]
    if affine:
        arrays += [randn(*shape), randn(*shape)]

    def ours(x: ag.Tensor, *params: ag.Tensor) -> ag.Tensor:
        return F.layer_norm(x, normalized_shape, *params)

    def theirs(x: Any, *params: Any) -> Any:
        return torch.nn.functional.layer_norm(x, shape, *params)

    await compare_with_torch(torch, device, ours, theirs, arrays, rtol=1e-6, atol=1e-9)


async def test_layer_norm_gradcheck_and_gradgradcheck() -> None:
    args = (leaf(randn(2, 3)), leaf(randn(3)), leaf(randn(3)))
    assert await ag.gradcheck(lambda x, w, b: F.layer_norm(x, (3,), w, b), args)
    assert await ag.gradgradcheck(lambda x, w, b: F.layer_norm(x, (3,), w, b), args)


def test_layer_norm_validates_shapes() -> None:
    with pytest.raises(RuntimeError, match=r"normalized_shape=\[4\].*size \[2, 3\]"):
        F.layer_norm(leaf(randn(2, 3)), 4)
    with pytest.raises(RuntimeError, match=r"weight of shape \[2\] and normalized_shape = \[3\]"):
        F.layer_norm(leaf(randn(2, 3)), 3, leaf(randn(2)))


# ------------------------------------------------------------------------------ conv2d
CONV_CASES = [
    # (input shape, weight shape, stride, padding, dilation, groups)
    ((2, 3, 7, 6), (4, 3, 3, 3), 1, 0, 1, 1),
    ((2, 3, 7, 6), (4, 3, 3, 2), 2, 1, 1, 1),
    ((1, 4, 8, 8), (6, 2, 3, 3), (2, 1), (1, 2), (2, 1), 2),
    ((2, 4, 6, 6), (4, 1, 2, 2), 3, 0, 1, 4),
    ((1, 2, 5, 6), (3, 2, 2, 3), 1, "same", (2, 1), 1),
    ((1, 2, 5, 5), (3, 2, 4, 4), 1, "valid", 1, 1),
    ((2, 5, 5), (3, 2, 3, 3), 1, 1, 1, 1),  # unbatched
]


@pytest.mark.parametrize(
    ("input_shape", "weight_shape", "stride", "padding", "dilation", "groups"), CONV_CASES
)
@pytest.mark.parametrize("with_bias", [True, False])
async def test_conv2d_matches_torch(
    torch: Any,
    device: str,
    input_shape: tuple[int, ...],
    weight_shape: tuple[int, ...],
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    with_bias: bool,
) -> None:
    arrays = [randn(*input_shape), randn(*weight_shape)]
    if with_bias:
        arrays.append(randn(weight_shape[0]))
    kwargs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    await compare_with_torch(
        torch,
        device,
        lambda x, w, b=None: F.conv2d(x, w, b, **kwargs),
        lambda x, w, b=None: torch.nn.functional.conv2d(x, w, b, **kwargs),
        arrays,
    )


@pytest.mark.parametrize(
    ("stride", "padding", "dilation", "groups"), [(1, 0, 1, 1), (2, 1, 1, 2), (1, 1, 2, 1)]
)
async def test_conv2d_gradcheck(stride: int, padding: int, dilation: int, groups: int) -> None:
    args = (leaf(randn(1, 2, 5, 5)), leaf(randn(2, 2 // groups, 2, 2)), leaf(randn(2)))
    assert await ag.gradcheck(
        lambda x, w, b: F.conv2d(x, w, b, stride, padding, dilation, groups), args
    )


async def test_conv2d_gradgradcheck() -> None:
    args = (leaf(randn(1, 1, 3, 3)), leaf(randn(2, 1, 2, 2)), leaf(randn(2)))
    assert await ag.gradgradcheck(lambda x, w, b: F.conv2d(x, w, b, padding=1, stride=2), args)


async def test_im2col_and_col2im_are_adjoint_and_differentiable() -> None:
    x = leaf(randn(1, 2, 4, 4))
    # Padded to 5 x 6; taps span 2 x 3 (dilation 1, 2); strides 2, 1: a 2 x 4 output.
    geometry = ConvGeometry((1, 2, 4, 4), (2, 2), (2, 1), ((1, 0), (1, 1)), (1, 2), (2, 4))
    cols = Im2Col.apply(x, geometry)
    assert tuple(cols.shape) == (2, 2, 2, 1, 2, 4)
    c = leaf(randn(*cols.shape))
    lhs = float((to_numpy(cols) * to_numpy(c.detach())).sum())
    rhs = float((to_numpy(x.detach()) * to_numpy(Col2Im.apply(c.detach(), geometry))).sum())
    assert abs(lhs - rhs) < 1e-12
    assert await ag.gradcheck(lambda t: Im2Col.apply(t, geometry), (x,))
    assert await ag.gradgradcheck(lambda t: Col2Im.apply(t, geometry), (c,))


@pytest.mark.parametrize(
    ("input_shape", "weight_shape", "kwargs", "error", "match"),
    [
        ((1, 2, 5, 5), (4, 3, 3, 3), {}, RuntimeError, r"expected input\[1, 2, 5, 5\] to have 3"),
        ((1, 4, 5, 5), (3, 2, 3, 3), {"groups": 2}, RuntimeError, "divisible by 2"),
        ((1, 3, 2, 2), (4, 3, 3, 3), {}, RuntimeError, r"Kernel size: \(3 x 3\)"),
        ((1, 3, 5, 5), (4, 3, 3, 3), {"bias": (3,)}, RuntimeError, "bias of size \\[3\\]"),
        ((3, 5), (4, 3, 3, 3), {}, RuntimeError, "3D \\(unbatched\\) or 4D"),
        ((1, 3, 5, 5), (4, 3, 3), {}, RuntimeError, "4-dimensional weight"),
        ((1, 3, 5, 5), (4, 3, 3, 3), {"stride": 0}, RuntimeError, "non-positive stride"),
        ((1, 3, 5, 5), (4, 3, 3, 3), {"padding": -1}, RuntimeError, "negative padding"),
        ((1, 3, 5, 5), (4, 3, 3, 3), {"dilation": 0}, RuntimeError, "dilation"),
        ((1, 3, 5, 5), (4, 3, 3, 3), {"padding": "same", "stride": 2}, ValueError, "strided"),
        ((1, 3, 5, 5), (4, 3, 3, 3), {"padding": "full"}, ValueError, "Invalid padding string"),
    ],
)
def test_conv2d_validates_arguments(
    input_shape: tuple[int, ...],
    weight_shape: tuple[int, ...],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    if "bias" in kwargs:
        kwargs = {**kwargs, "bias": leaf(randn(*kwargs["bias"]))}
    with pytest.raises(error, match=match):
        F.conv2d(leaf(randn(*input_shape)), leaf(randn(*weight_shape)), **kwargs)
