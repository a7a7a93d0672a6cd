"""Tests of aioautograd.nn modules: Parameter, Module registration and walking, modes,
zero_grad, state dicts, device/dtype moves, and every layer against torch.nn on identical
weights (outputs, input gradients and parameter gradients)."""

from __future__ import annotations

import asyncio
import copy
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
import aioautograd.nn.functional as F
from aioautograd import nn
from tests.helpers import assert_close, to_numpy


def randn(*shape: int) -> np.ndarray[Any, Any]:
    # NumPy's global generator: tests/conftest.py seeds it before every test.
    return np.random.standard_normal(shape)


class Block(nn.Module):
    """A small custom module: a parameter, a buffer, a non-persistent buffer, submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(ag.ones(3))
        self.register_buffer("running", ag.zeros(3))
        self.register_buffer("scratch", ag.zeros(2), persistent=False)
        self.inner = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3))
        self.head = nn.Linear(3, 2, bias=False)

    def forward(self, x: ag.Tensor) -> ag.Tensor:
        return self.head(self.inner(x * self.scale))


# --------------------------------------------------------------------------- Parameter
def test_parameter_is_a_leaf_tensor_sharing_the_source_data() -> None:
    source = ag.randn(3, 4)
    param = nn.Parameter(source)
    assert isinstance(param, ag.Tensor)
    assert param.requires_grad
    assert param.is_leaf
    assert param.data is source.data
    with ag.no_grad():
        param.add_(1.0)
    assert source._version == param._version == 1  # one storage, one version counter
    assert repr(param).startswith("Parameter containing:\ntensor(")


def test_parameter_from_array_and_without_grad() -> None:
    array = np.arange(6.0).reshape(2, 3)
    param = nn.Parameter(array, requires_grad=False)
    assert not param.requires_grad
    assert param.data is array
    assert param.device is ag.device("cpu")
    assert nn.Parameter().shape == (0,)


def test_parameter_of_integer_dtype_cannot_require_grad() -> None:
    with pytest.raises(RuntimeError, match="floating point"):
        nn.Parameter(ag.arange(3))
    assert not nn.Parameter(ag.arange(3), requires_grad=False).requires_grad


def test_parameter_gradient_flows_through_ops() -> None:
    param = nn.Parameter(ag.tensor([1.0, 2.0]))
    out = (param * param).sum()
    out.backward_sync()
    assert type(out) is ag.Tensor
    assert_close(param.grad, [2.0, 4.0])


# ---------------------------------------------------------------------- registration
def test_setattr_registers_parameters_buffers_and_modules_in_order() -> None:
    block = Block()
    assert [name for name, _ in block.named_parameters()] == [
        "scale",
        "inner.0.weight",
        "inner.0.bias",
        "inner.2.weight",
        "inner.2.bias",
        "head.weight",
    ]
    assert [name for name, _ in block.named_buffers()] == ["running", "scratch"]
    assert [name for name, _ in block.named_children()] == ["inner", "head"]
    assert [name for name, _ in block.named_modules()] == [
        "",
        "inner",
        "inner.0",
        "inner.1",
        "inner.2",
        "head",
    ]
    assert list(block.children()) == [block.inner, block.head]
    assert next(block.modules()) is block
    assert len(list(block.parameters(recurse=False))) == 1
    assert block.head.bias is None


def test_reassigning_attributes_moves_them_between_registries() -> None:
    block = Block()
    block.scale = None
    assert "scale" not in dict(block.named_parameters())
    block.head = None
    assert [name for name, _ in block.named_children()] == ["inner"]
    block.running = ag.ones(3)
    assert_close(block.running, np.ones(3))
    del block.running
    assert "running" not in dict(block.named_buffers())
    with pytest.raises(AttributeError, match="no attribute 'running'"):
        _ = block.running
    block.plain = 3  # neither parameter, module nor buffer: an ordinary attribute
    assert block.plain == 3
    assert "plain" not in dict(block.named_parameters())


def test_assignment_type_errors() -> None:
    block = Block()
    with pytest.raises(TypeError, match="cannot assign 'Tensor' as parameter 'scale'"):
        block.scale = ag.ones(3)
    with pytest.raises(TypeError, match="child module 'inner'"):
        block.inner = 3
    with pytest.raises(TypeError, match="buffer 'running'"):
        block.running = np.zeros(3)
    with pytest.raises(KeyError, match="contain"):
        block.register_buffer("a.b", ag.zeros(1))
    with pytest.raises(KeyError, match="already exists"):
        block.register_parameter("training", nn.Parameter(ag.zeros(1)))
    with pytest.raises(TypeError, match="Parameter or None required"):
        block.register_parameter("w", ag.zeros(1))  # type: ignore[arg-type]
    # A parameter that does not require grad becomes a non-leaf when an in-place op mixes
    # in a tensor that does.
    non_leaf = nn.Parameter(ag.ones(1), requires_grad=False)
    non_leaf.add_(ag.ones(1, requires_grad=True))
    with pytest.raises(ValueError, match="non-leaf"):
        block.register_parameter("w", non_leaf)


def test_assigning_before_init_raises() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            self.weight = nn.Parameter(ag.ones(1))

    with pytest.raises(AttributeError, match=r"before Module.__init__\(\) call"):
        Broken()


def test_missing_forward_raises() -> None:
    with pytest.raises(NotImplementedError, match='missing the required "forward"'):
        nn.Module()(ag.ones(1))


def test_shared_parameters_are_yielded_once() -> None:
    first = nn.Linear(3, 3)
    second = nn.Linear(3, 3)
    second.weight = first.weight
    model = nn.Sequential(first, second, first)
    assert len(list(model.parameters())) == 3
    assert [name for name, _ in model.named_modules()] == ["", "0", "1"]
    # state_dict keeps every name, as PyTorch does
    assert list(model.state_dict()) == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "2.weight",
        "2.bias",
    ]


def test_apply_visits_children_first_and_requires_grad_freezes() -> None:
    block = Block()
    visited: list[str] = []
    block.apply(lambda module: visited.append(type(module).__name__))
    assert visited[-1] == "Block"
    assert visited.index("Sequential") > visited.index("ReLU")
    block.inner.requires_grad_(False)
    trainable = [name for name, p in block.named_parameters() if p.requires_grad]
    assert trainable == ["scale", "head.weight"]


def test_deep_module_tree_does_not_recurse() -> None:
    model: nn.Module = nn.Linear(1, 1)
    for _ in range(3000):
        model = nn.Sequential(model)
    assert len(list(model.parameters())) == 2
    assert len(model.state_dict()) == 2


# ------------------------------------------------------------------------- modes
def test_train_and_eval_propagate_to_every_module() -> None:
    block = Block()
    assert all(module.training for module in block.modules())
    assert block.eval() is block
    assert not any(module.training for module in block.modules())
    block.train()
    assert all(module.training for module in block.modules())
    with pytest.raises(ValueError, match="boolean"):
        block.train("yes")  # type: ignore[arg-type]


def test_dropout_train_eval_switching() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = ag.randn(64, 8)
    eval_out = model.eval()(x)
    assert_close(eval_out, model[0](x))
    train_out = model.train()(x)
    zeros = to_numpy(train_out) == 0
    assert 0.3 < zeros.mean() < 0.7
    kept = ~zeros
    assert_close(to_numpy(train_out)[kept], 2 * to_numpy(eval_out)[kept], rtol=1e-6)


def test_dropout_gradient_follows_the_mask() -> None:
    dropout = nn.Dropout(0.25)
    x = ag.ones(1000, dtype="float64", requires_grad=True)
    out = dropout(x)
    out.sum().backward_sync()
    assert_close(x.grad, to_numpy(out))
    assert set(np.unique(to_numpy(out))) == {0.0, 1 / 0.75}


def test_dropout_rejects_bad_probability() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        nn.Dropout(1.5)


# ------------------------------------------------------------------------- zero_grad
@pytest.mark.parametrize("set_to_none", [True, False])
def test_module_zero_grad(set_to_none: bool) -> None:
    model = nn.Linear(3, 2)
    model(ag.randn(4, 3)).sum().backward_sync()
    grad = model.weight.grad
    assert grad is not None
    assert np.abs(to_numpy(grad)).sum() > 0
    model.zero_grad(set_to_none=set_to_none)
    if set_to_none:
        assert model.weight.grad is None
        assert model.bias.grad is None
    else:
        assert model.weight.grad is grad  # zeroed in place, same tensor
        assert not np.any(to_numpy(grad))
        assert not np.any(to_numpy(model.bias.grad))
    model(ag.randn(4, 3)).sum().backward_sync()
    assert model.weight.grad is not None


async def test_zero_grad_in_place_then_accumulates_fresh_gradient() -> None:
    model = nn.Linear(2, 1, bias=False)
    x = ag.tensor([[1.0, 2.0]])
    await model(x).sum().backward()
    await model(x).sum().backward()
    assert_close(model.weight.grad, [[2.0, 4.0]])
    model.zero_grad(set_to_none=False)
    await model(x).sum().backward()
    assert_close(model.weight.grad, [[1.0, 2.0]])


# ----------------------------------------------------------------------- state dicts
def test_state_dict_holds_numpy_copies_of_persistent_state() -> None:
    block = Block()
    state = block.state_dict()
    assert isinstance(state, OrderedDict)
    assert list(state) == [
        "scale",
        "running",
        "inner.0.weight",
        "inner.0.bias",
        "inner.2.weight",
        "inner.2.bias",
        "head.weight",
    ]
    assert all(type(value) is np.ndarray for value in state.values())
    state["scale"][:] = 7.0
    assert_close(block.scale, np.ones(3))  # a copy, not a view
    assert block.state_dict(keep_vars=True)["scale"] is block.scale


def test_state_dict_keys_match_torch(torch: Any) -> None:
    ours = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.GELU(), nn.Linear(4, 2))
    theirs = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.GELU(), torch.nn.Linear(4, 2)
    )
    assert list(ours.state_dict()) == list(theirs.state_dict())
    shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert {k: v.shape for k, v in ours.state_dict().items()} == shapes


async def test_state_dict_round_trip_restores_outputs() -> None:
    source = Block()
    with ag.no_grad():
        source.running.add_(5.0)
    target = Block()
    weight = target.head.weight
    version = weight._version
    x = ag.randn(2, 3)
    assert not np.allclose(to_numpy(source(x)), to_numpy(target(x)))
    result = target.load_state_dict(source.state_dict())
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    assert_close(target(x), source(x))
    assert_close(target.running, np.full(3, 5.0))
    assert target.head.weight is weight  # copied in place: optimizers keep their references
    assert weight._version > version
    assert weight.requires_grad
    assert weight.is_leaf
    await target(x).sum().backward()
    assert weight.grad is not None


def test_load_state_dict_accepts_tensors() -> None:
    source, target = nn.Linear(3, 2), nn.Linear(3, 2)
    target.load_state_dict(source.state_dict(keep_vars=True))
    assert_close(target.weight.detach(), source.weight.detach())


def test_load_state_dict_strict_lists_missing_and_unexpected_keys() -> None:
    model = nn.Linear(3, 2)
    state = model.state_dict()
    state.pop("bias")
    state["extra"] = np.zeros(1)
    before = to_numpy(model.weight.detach()).copy()
    state["weight"] = state["weight"] + 1.0
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(state)
    message = str(info.value)
    assert "Error(s) in loading state_dict for Linear" in message
    assert 'Missing key(s) in state_dict: "bias".' in message
    assert 'Unexpected key(s) in state_dict: "extra".' in message
    assert_close(model.weight.detach(), before)  # nothing copied on error


def test_load_state_dict_non_strict_reports_keys() -> None:
    model = nn.Linear(3, 2)
    new_weight = np.full((2, 3), 0.5, dtype=np.float32)
    result = model.load_state_dict({"weight": new_weight, "extra": np.zeros(1)}, strict=False)
    assert result.missing_keys == ["bias"]
    assert result.unexpected_keys == ["extra"]
    assert_close(model.weight.detach(), new_weight)


def test_load_state_dict_shape_mismatch_raises_even_when_not_strict() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: .*\(4, 3\).*\(2, 3\)"):
        model.load_state_dict({"weight": np.zeros((4, 3))}, strict=False)


def test_non_persistent_buffers_stay_out_of_state_dict() -> None:
    block = Block()
    assert "scratch" not in block.state_dict()
    assert "scratch" in dict(block.named_buffers())


# --------------------------------------------------------------------- device, dtype
def test_to_dtype_converts_in_place_and_keeps_identity() -> None:
    model = nn.Linear(3, 2)
    weight = model.weight
    model(ag.randn(1, 3)).sum().backward_sync()
    assert model.double() is model
    assert model.weight is weight
    assert weight.dtype == np.float64
    assert weight.grad is not None
    assert weight.grad.dtype == np.float64
    out = model(ag.randn(4, 3, dtype="float64"))
    assert out.dtype == np.float64
    with pytest.raises(TypeError, match="floating point"):
        model.to(ag.int64)


async def test_to_device_moves_parameters_and_buffers(device: str) -> None:
    block = Block()
    weight = block.head.weight
    assert block.to(device) is block
    assert block.head.weight is weight
    assert all(str(t.device) == device for t in [*block.parameters(), *block.buffers()])
    out = block(ag.randn(2, 3, device=device))
    assert str(out.device) == device
    await out.sum().backward()
    assert str(weight.grad.device) == device
    block.cpu()
    assert all(t.device is ag.device("cpu") for t in block.parameters())


# ------------------------------------------------------------------- copy and pickle
def test_deepcopy_gives_independent_parameters_and_gradients() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    model(ag.randn(4, 2)).sum().backward_sync()
    clone = copy.deepcopy(model)
    for original, copied in zip(model.parameters(), clone.parameters(), strict=True):
        assert isinstance(copied, nn.Parameter)
        assert copied is not original
        assert copied.data is not original.data
        assert copied.requires_grad
        assert_close(copied.grad, original.grad)
    model.zero_grad()
    clone.zero_grad()
    clone(ag.randn(4, 2)).sum().backward_sync()
    assert clone[0].weight.grad is not None
    assert model[0].weight.grad is None  # the copy's gradients stay in the copy
    tied = nn.Sequential(model[0], model[0])
    tied_clone = copy.deepcopy(tied)
    assert tied_clone[0].weight is tied_clone[1].weight


def test_pickle_round_trip() -> None:
    model = Block()
    model(ag.randn(2, 3)).sum().backward_sync()  # creates gradient accumulators
    restored = pickle.loads(pickle.dumps(model))
    x = ag.randn(2, 3)
    assert_close(restored(x), model(x))
    assert list(restored.state_dict()) == list(model.state_dict())
    assert isinstance(restored.inner[0].bias, nn.Parameter)
    assert restored.inner[0].bias.requires_grad


# --------------------------------------------------------------------------- repr
def test_repr_matches_torch(torch: Any) -> None:
    ours = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, (3, 1), stride=2, groups=2, bias=False),
        nn.Flatten(),
        nn.Linear(8, 16),
        nn.GELU(approximate="tanh"),
        nn.LayerNorm(16),
        nn.Linear(16, 2, bias=False),
    )
    theirs = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(4, 4, (3, 1), stride=2, groups=2, bias=False),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 16),
        torch.nn.GELU(approximate="tanh"),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 2, bias=False),
    )
    assert repr(ours) == repr(theirs)
    assert repr(nn.Embedding(10, 3, padding_idx=0)) == repr(
        torch.nn.Embedding(10, 3, padding_idx=0)
    )
    assert repr(Block()).startswith("Block(\n  (inner): Sequential(\n    (0): Linear(")


# ----------------------------------------------------------------------- containers
def test_sequential_indexing_and_names() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert len(model) == 3
    assert isinstance(model[-1], nn.Linear)
    head = model[1:]
    assert isinstance(head, nn.Sequential)
    assert [name for name, _ in head.named_children()] == ["1", "2"]
    assert list(model) == [model[0], model[1], model[2]]
    model.append(nn.GELU())
    assert [name for name, _ in model.named_children()] == ["0", "1", "2", "3"]
    with pytest.raises(IndexError, match="out of range"):
        model[4]
    named = nn.Sequential(OrderedDict([("encoder", nn.Linear(2, 2)), ("act", nn.ReLU())]))
    assert [name for name, _ in named.named_parameters()] == ["encoder.weight", "encoder.bias"]
    x = ag.randn(5, 2)
    assert_close(named(x), F.relu(named.encoder(x)))


def test_module_list_registers_its_modules() -> None:
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    assert len(layers) == 3
    assert len(list(layers.parameters())) == 6
    layers.append(nn.Linear(4, 1))
    assert [name for name, _ in layers.named_parameters()][-1] == "3.bias"
    assert isinstance(layers[1:], nn.ModuleList)
    assert layers[-1].out_features == 1


# --------------------------------------------------------------------- initialisation
def test_linear_and_conv_default_init_bounds() -> None:
    linear = nn.Linear(400, 300)
    bound = 1 / np.sqrt(400)
    weight = to_numpy(linear.weight.detach())
    assert weight.dtype == np.float32
    assert np.abs(weight).max() <= bound
    assert abs(weight.std() - bound / np.sqrt(3)) < 0.01 * bound
    assert np.abs(to_numpy(linear.bias.detach())).max() <= bound
    conv = nn.Conv2d(4, 8, 3, groups=2)
    conv_bound = 1 / np.sqrt(2 * 9)
    assert conv.weight.shape == (8, 2, 3, 3)
    assert np.abs(to_numpy(conv.weight.detach())).max() <= conv_bound
    assert np.abs(to_numpy(conv.bias.detach())).max() <= conv_bound


def test_embedding_and_layer_norm_init() -> None:
    embedding = nn.Embedding(500, 20, padding_idx=-1)
    assert embedding.padding_idx == 499
    weight = to_numpy(embedding.weight.detach())
    assert not np.any(weight[499])
    assert abs(weight[:499].std() - 1.0) < 0.05
    norm = nn.LayerNorm((2, 3), elementwise_affine=True)
    assert_close(norm.weight.detach(), np.ones((2, 3)))
    assert_close(norm.bias.detach(), np.zeros((2, 3)))
    assert nn.LayerNorm(3, elementwise_affine=False).weight is None


def test_manual_seed_makes_init_reproducible() -> None:
    ag.manual_seed(123)
    first = nn.Linear(5, 5)
    ag.manual_seed(123)
    second = nn.Linear(5, 5)
    assert_close(first.weight.detach(), second.weight.detach(), rtol=0, atol=0)


def test_layer_argument_validation() -> None:
    with pytest.raises(ValueError, match="in_channels must be divisible by groups"):
        nn.Conv2d(3, 4, 3, groups=2)
    with pytest.raises(ValueError, match="padding_mode"):
        nn.Conv2d(1, 1, 3, padding_mode="reflect")
    with pytest.raises(ValueError, match="strided"):
        nn.Conv2d(1, 1, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="approximate"):
        nn.GELU("fast")
    with pytest.raises(ValueError, match="Padding_idx"):
        nn.Embedding(3, 2, padding_idx=3)


def test_embedding_from_pretrained() -> None:
    table = ag.randn(4, 3)
    frozen = nn.Embedding.from_pretrained(table)
    assert not frozen.weight.requires_grad
    assert_close(frozen(ag.tensor([2, 0])), to_numpy(table)[[2, 0]])
    assert nn.Embedding.from_pretrained(table, freeze=False).weight.requires_grad


# ---------------------------------------------------------------- layers vs torch.nn
async def compare_layer_with_torch(
    torch: Any,
    device: str,
    ours: nn.Module,
    theirs: Any,
    input_array: np.ndarray[Any, Any],
    rtol: float = 1e-7,
    atol: float = 1e-10,
) -> None:
    """Give ``theirs`` our weights (through ``state_dict``, so the names must match), run both
    on ``input_array`` and compare outputs, the input gradient and every parameter gradient."""
    ours.to(device)
    theirs.load_state_dict({k: torch.tensor(v) for k, v in ours.state_dict().items()})
    floating = input_array.dtype.kind == "f"
    x = ag.tensor(input_array, device=device, requires_grad=floating)
    x_torch = torch.tensor(input_array, requires_grad=floating)
    out = ours(x)
    expected = theirs(x_torch)
    assert tuple(out.shape) == tuple(expected.shape)
    assert_close(out, expected, rtol=rtol, atol=atol)
    seed = randn(*expected.shape)
    await out.backward(ag.tensor(seed, dtype=out.dtype, device=device))
    expected.backward(torch.tensor(seed, dtype=expected.dtype))
    if floating:
        assert_close(x.grad, x_torch.grad, rtol=rtol, atol=atol)
    their_params = dict(theirs.named_parameters())
    our_params = dict(ours.named_parameters())
    assert list(our_params) == list(their_params)
    for name, param in our_params.items():
        assert param.grad is not None, name
        assert_close(param.grad, their_params[name].grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3,), (5, 3), (2, 4, 3)])
async def test_linear_matches_torch(
    torch: Any, device: str, bias: bool, shape: tuple[int, ...]
) -> None:
    ours = nn.Linear(3, 4, bias=bias, dtype="float64")
    theirs = torch.nn.Linear(3, 4, bias=bias, dtype=torch.float64)
    await compare_layer_with_torch(torch, device, ours, theirs, randn(*shape))


@pytest.mark.parametrize(
    ("make_ours", "make_theirs"),
    [
        (nn.ReLU, lambda t: t.nn.ReLU()),
        (nn.GELU, lambda t: t.nn.GELU()),
        (lambda: nn.GELU("tanh"), lambda t: t.nn.GELU("tanh")),
        (nn.Flatten, lambda t: t.nn.Flatten()),
    ],
    ids=["relu", "gelu", "gelu_tanh", "flatten"],
)
async def test_parameterless_layers_match_torch(
    torch: Any,
    device: str,
    make_ours: Callable[[], nn.Module],
    make_theirs: Callable[[Any], Any],
) -> None:
    await compare_layer_with_torch(torch, device, make_ours(), make_theirs(torch), randn(2, 3, 4))


@pytest.mark.parametrize("padding_idx", [None, 1])
async def test_embedding_matches_torch(torch: Any, device: str, padding_idx: int | None) -> None:
    ours = nn.Embedding(5, 3, padding_idx=padding_idx, dtype="float64")
    theirs = torch.nn.Embedding(5, 3, padding_idx=padding_idx, dtype=torch.float64)
    indices = np.array([[0, 1, 4], [1, 1, 3]])
    await compare_layer_with_torch(torch, device, ours, theirs, indices)
    if padding_idx is not None:
        assert not np.any(to_numpy(ours.weight.grad)[padding_idx])


@pytest.mark.parametrize(
    ("normalized_shape", "kwargs"),
    [
        ((4,), {}),
        ((3, 4), {"eps": 1e-3}),
        ((4,), {"elementwise_affine": False}),
        ((4,), {"bias": False}),
    ],
)
async def test_layer_norm_matches_torch(
    torch: Any, device: str, normalized_shape: tuple[int, ...], kwargs: dict[str, Any]
) -> None:
    ours = nn.LayerNorm(normalized_shape, dtype="float64", **kwargs)
    theirs = torch.nn.LayerNorm(normalized_shape, dtype=torch.float64, **kwargs)
    # Non-trivial affine parameters, so their gradients are tested at a generic point.
    with ag.no_grad():
        for param in ours.parameters():
            param.copy_(randn(*param.shape))
    await compare_layer_with_torch(torch, device, ours, theirs, randn(2, 3, 4), rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"stride": 2, "padding": 1},
        {"padding": "same", "dilation": 2, "bias": False},
        {"groups": 2, "padding": (1, 0)},
    ],
    ids=["plain", "stride_padding", "same_dilation", "groups"],
)
async def test_conv2d_matches_torch(torch: Any, device: str, kwargs: dict[str, Any]) -> None:
    ours = nn.Conv2d(2, 4, 3, dtype="float64", **kwargs)
    theirs = torch.nn.Conv2d(2, 4, 3, dtype=torch.float64, **kwargs)
    await compare_layer_with_torch(torch, device, ours, theirs, randn(2, 2, 7, 6))


async def test_sequential_model_matches_torch(torch: Any, device: str) -> None:
    ours = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.GELU(),
        nn.Flatten(),
        nn.LayerNorm(48),
        nn.Linear(48, 8),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(8, 2),
    ).double()
    theirs = torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3, padding=1),
        torch.nn.GELU(),
        torch.nn.Flatten(),
        torch.nn.LayerNorm(48),
        torch.nn.Linear(48, 8),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(8, 2),
    ).double()
    ours.eval()
    theirs.eval()
    await compare_layer_with_torch(torch, device, ours, theirs, randn(3, 1, 4, 4), rtol=1e-6)


def test_loss_modules_match_functional() -> None:
    logits = ag.randn(4, 3)
    target = ag.tensor([0, 2, 1, 2])
    weight = ag.tensor([1.0, 2.0, 0.5])
    loss = nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    assert "weight" in loss.state_dict()
    assert_close(loss(logits, target), F.cross_entropy(logits, target, weight, label_smoothing=0.1))
    prediction, wanted = ag.randn(5), ag.randn(5)
    assert_close(
        nn.MSELoss(reduction="sum")(prediction, wanted),
        F.mse_loss(prediction, wanted, reduction="sum"),
    )


# ------------------------------------------------------------------------ concurrency
async def test_concurrent_backward_through_shared_module_accumulates() -> None:
    model = nn.Linear(3, 1, bias=False)
    inputs = [ag.randn(2, 3) for _ in range(8)]

    async def backward(x: ag.Tensor) -> None:
        await model(x).sum().backward()

    await asyncio.gather(*(backward(x) for x in inputs))
    expected = sum(to_numpy(x).sum(axis=0) for x in inputs)
    assert_close(model.weight.grad, expected[None, :], rtol=1e-5)
