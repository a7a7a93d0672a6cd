"""Tests of aioautograd.optim: each optimizer step by step against torch.optim with identical
parameters and gradients, parameter groups, zero_grad, state dicts, version counters,
argument validation, and small MLPs trained to high accuracy with ``await loss.backward()``."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
import aioautograd.nn.functional as F
from aioautograd import nn, optim
from tests.helpers import assert_close, to_numpy

SHAPES = [(3, 4), (4,), ()]

OPTIMIZER_CASES: list[tuple[str, dict[str, Any]]] = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.05}),
    ("SGD", {"lr": 0.1, "momentum": 0.8, "nesterov": True, "weight_decay": 0.1}),
    ("SGD", {"lr": 0.05, "momentum": 0.5, "maximize": True}),
    ("Adam", {}),
    ("Adam", {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("Adam", {"lr": 0.05, "amsgrad": True}),
    ("Adam", {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    ("AdamW", {}),
    ("AdamW", {"lr": 0.05, "weight_decay": 0.3}),
    ("AdamW", {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}),
]


def case_id(case: tuple[str, dict[str, Any]]) -> str:
    name, kwargs = case
    return name + "".join(f"-{key}={value}" for key, value in kwargs.items())


def make_params(arrays: list[np.ndarray[Any, Any]], device: str = "cpu") -> list[nn.Parameter]:
    return [nn.Parameter(ag.tensor(a, dtype="float64", device=device)) for a in arrays]


def set_grads(params: list[Any], grads: list[np.ndarray[Any, Any]], device: str) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = ag.tensor(grad, dtype="float64", device=device)


# ------------------------------------------------------------------ against torch.optim
@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=case_id)
def test_steps_match_torch(torch: Any, device: str, case: tuple[str, dict[str, Any]]) -> None:
    name, kwargs = case
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(shape) for shape in SHAPES]
    ours = make_params(arrays, device)
    theirs = [torch.nn.Parameter(torch.tensor(a)) for a in arrays]
    our_optimizer = getattr(optim, name)(ours, **kwargs)
    their_optimizer = getattr(torch.optim, name)(theirs, **kwargs)
    for _ in range(6):
        grads = [rng.standard_normal(shape) for shape in SHAPES]
        set_grads(ours, grads, device)
        for param, grad in zip(theirs, grads, strict=True):
            param.grad = torch.tensor(grad)
        our_optimizer.step()
        their_optimizer.step()
        for mine, reference in zip(ours, theirs, strict=True):
            assert str(mine.device) == device
            assert mine.dtype == np.float64
            assert_close(mine.detach(), reference, rtol=1e-12, atol=1e-14)
    assert not np.allclose(to_numpy(ours[0].detach()), arrays[0])  # the steps did move it


def _reference_step(
    name: str, kwargs: dict[str, Any], p: Any, g: Any, state: dict[str, Any]
) -> Any:
    """One step of the textbook update, every operation out of place (as the optimizers
    computed it before they wrote into scratch arrays); returns the new parameter."""
    if name == "SGD":
        lr, momentum = kwargs["lr"], kwargs.get("momentum", 0.0)
        dampening, weight_decay = kwargs.get("dampening", 0.0), kwargs.get("weight_decay", 0.0)
        if kwargs.get("maximize"):
            g = -g
        if weight_decay:
            g = g + weight_decay * p
        if momentum:
            if "b" not in state:
                state["b"] = g.copy()
            else:
                state["b"] = state["b"] * momentum
                state["b"] = state["b"] + (1 - dampening) * g
            g = g + momentum * state["b"] if kwargs.get("nesterov") else state["b"]
        return p + g * -lr
    lr, (beta1, beta2) = kwargs.get("lr", 1e-3), kwargs.get("betas", (0.9, 0.999))
    eps, weight_decay = kwargs.get("eps", 1e-8), kwargs.get("weight_decay", 0.0)
    if name == "AdamW" and "weight_decay" not in kwargs:
        weight_decay = 1e-2
    if kwargs.get("maximize"):
        g = -g
    step = state["step"] = state.get("step", 0) + 1
    if weight_decay and name == "AdamW":
        p = p * (1 - lr * weight_decay)
    elif weight_decay:
        g = g + weight_decay * p
    m, v = state.get("m", np.zeros_like(p)), state.get("v", np.zeros_like(p))
    m = m + (1 - beta1) * (g - m)
    v = v * beta2
    v = v + (1 - beta2) * g * g
    state["m"], state["v"] = m, v
    if kwargs.get("amsgrad"):
        state["vmax"] = np.maximum(state.get("vmax", np.zeros_like(p)), v)
        v = state["vmax"]
    denom = np.sqrt(v) / math.sqrt(1 - beta2**step) + eps
    return p + (m / denom) * -(lr / (1 - beta1**step))


@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=case_id)
def test_steps_are_bitwise_the_out_of_place_formula(case: tuple[str, dict[str, Any]]) -> None:
    # float32 makes every rounding visible: the in-place updates (``out=`` into scratch
    # arrays) must give exactly the bits of the expressions written out of place.
    name, kwargs = case
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
    params = [nn.Parameter(ag.tensor(a)) for a in arrays]
    optimizer = getattr(optim, name)(params, **kwargs)
    expected = [a.copy() for a in arrays]
    states: list[dict[str, Any]] = [{} for _ in arrays]
    for _ in range(4):
        grads = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
        for param, grad in zip(params, grads, strict=True):
            param.grad = ag.tensor(grad)
        optimizer.step()
        for i, grad in enumerate(grads):
            expected[i] = _reference_step(name, kwargs, expected[i], grad, states[i])
            got = to_numpy(params[i].detach())
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, np.asarray(expected[i], np.float32))
        for param, grad in zip(params, grads, strict=True):  # the gradients stay untouched
            np.testing.assert_array_equal(to_numpy(param.grad), grad)
    assert not np.array_equal(to_numpy(params[0].detach()), arrays[0])


def test_param_groups_match_torch(torch: Any) -> None:
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal((2, 3)), rng.standard_normal(3)]
    ours = make_params(arrays)
    theirs = [torch.nn.Parameter(torch.tensor(a)) for a in arrays]

    def groups(params: list[Any]) -> list[dict[str, Any]]:
        return [{"params": [params[0]]}, {"params": params[1], "lr": 0.5, "momentum": 0.0}]

    our_optimizer = optim.SGD(groups(ours), lr=0.1, momentum=0.9)
    their_optimizer = torch.optim.SGD(groups(theirs), lr=0.1, momentum=0.9)
    assert our_optimizer.param_groups[1]["lr"] == 0.5
    assert our_optimizer.param_groups[0]["momentum"] == 0.9
    for _ in range(3):
        grads = [rng.standard_normal(a.shape) for a in arrays]
        set_grads(ours, grads, "cpu")
        for param, grad in zip(theirs, grads, strict=True):
            param.grad = torch.tensor(grad)
        our_optimizer.step()
        their_optimizer.step()
    for mine, reference in zip(ours, theirs, strict=True):
        assert_close(mine.detach(), reference, rtol=1e-12)
    assert "momentum_buffer" not in our_optimizer.state[ours[1]]


def test_add_param_group_later(torch: Any) -> None:
    first, second = make_params([np.ones(2), np.ones(3)])
    optimizer = optim.Adam([first], lr=0.1)
    optimizer.add_param_group({"params": [second], "lr": 0.01})
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.01]
    assert optimizer.param_groups[1]["betas"] == (0.9, 0.999)
    set_grads([first, second], [np.ones(2), np.ones(3)], "cpu")
    optimizer.step()
    # Adam's first step moves every coordinate by about lr.
    assert_close(first.detach(), np.full(2, 0.9), rtol=1e-6)
    assert_close(second.detach(), np.full(3, 0.99), rtol=1e-6)


# ---------------------------------------------------------------- update semantics
def test_step_skips_parameters_without_grad() -> None:
    with_grad, without_grad = make_params([np.ones(2), np.ones(2)])
    optimizer = optim.Adam([with_grad, without_grad])
    set_grads([with_grad], [np.ones(2)], "cpu")
    optimizer.step()
    assert not optimizer.state.get(without_grad)
    assert optimizer.state[with_grad]["step"] == 1
    assert_close(without_grad.detach(), np.ones(2))


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
async def test_step_bumps_version_and_invalidates_saved_graph(name: str) -> None:
    param = nn.Parameter(ag.tensor([1.0, 2.0]))
    optimizer = getattr(optim, name)([param], lr=0.1)
    loss = (param * param).sum()  # saves param for backward
    param.grad = ag.tensor([1.0, 1.0])
    version = param._version
    optimizer.step()
    assert param._version > version
    assert param.is_leaf
    assert param.requires_grad
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        await loss.backward()


def test_step_with_closure_returns_loss() -> None:
    param = nn.Parameter(ag.tensor([3.0]))
    optimizer = optim.SGD([param], lr=0.25)

    def closure() -> ag.Tensor:
        optimizer.zero_grad()
        assert ag.is_grad_enabled()
        loss = (param * param).sum()
        loss.backward_sync()
        return loss

    with ag.no_grad():
        loss = optimizer.step(closure)
    assert loss.item() == pytest.approx(9.0)
    assert_close(param.detach(), [1.5])  # 3 - 0.25 * 6


@pytest.mark.parametrize("set_to_none", [True, False])
def test_optimizer_zero_grad(set_to_none: bool) -> None:
    params = make_params([np.ones(2), np.ones(3)])
    optimizer = optim.SGD(params, lr=0.1)
    set_grads(params, [np.ones(2), np.ones(3)], "cpu")
    grads = [p.grad for p in params]
    optimizer.zero_grad(set_to_none=set_to_none)
    for param, grad in zip(params, grads, strict=True):
        if set_to_none:
            assert param.grad is None
        else:
            assert param.grad is grad
            assert not np.any(to_numpy(grad))


# ----------------------------------------------------------------------- state dicts
@pytest.mark.parametrize("case", OPTIMIZER_CASES[1:12:2], ids=case_id)
def test_state_dict_round_trip_continues_identically(case: tuple[str, dict[str, Any]]) -> None:
    name, kwargs = case
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(shape) for shape in SHAPES]
    params = make_params(arrays)
    optimizer = getattr(optim, name)(params, **kwargs)
    for _ in range(3):
        set_grads(params, [rng.standard_normal(s) for s in SHAPES], "cpu")
        optimizer.step()
    saved = optimizer.state_dict()
    assert set(saved) == {"state", "param_groups"}
    assert saved["param_groups"][0]["params"] == [0, 1, 2]
    assert set(saved["state"]) == {0, 1, 2}
    snapshot = {k: np.array(v) for k, v in saved["state"][0].items()}

    clones = make_params([to_numpy(p.detach()) for p in params])
    restored = getattr(optim, name)(clones, lr=123.0)
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert restored.param_groups[0]["params"][0] is clones[0]
    for _ in range(2):
        grads = [rng.standard_normal(s) for s in SHAPES]
        set_grads(params, grads, "cpu")
        set_grads(clones, grads, "cpu")
        optimizer.step()
        restored.step()
        for mine, reference in zip(clones, params, strict=True):
            assert_close(mine.detach(), reference.detach(), rtol=0, atol=0)
    for key, value in saved["state"][0].items():  # a snapshot, not live state
        np.testing.assert_array_equal(np.array(value), snapshot[key])
    if "step" in saved["state"][0]:
        assert optimizer.state[params[0]]["step"] == saved["state"][0]["step"] + 2


def test_load_state_dict_casts_state_to_parameter_dtype() -> None:
    (param,) = make_params([np.ones(3)])
    optimizer = optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = ag.ones(3, dtype="float64")
    optimizer.step()
    saved = optimizer.state_dict()
    saved["state"][0]["momentum_buffer"] = saved["state"][0]["momentum_buffer"].astype("float32")
    optimizer.load_state_dict(saved)
    buffer = optimizer.state[param]["momentum_buffer"]
    assert isinstance(buffer, ag.Tensor)
    assert buffer.dtype == np.float64


def test_load_state_dict_rejects_mismatched_groups() -> None:
    params = make_params([np.ones(2), np.ones(3)])
    saved = optim.SGD(params, lr=0.1).state_dict()
    with pytest.raises(ValueError, match="different number of parameter groups"):
        optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.1).load_state_dict(saved)
    with pytest.raises(ValueError, match="doesn't match the size"):
        optim.SGD(params[:1], lr=0.1).load_state_dict(saved)


def test_module_and_optimizer_checkpoint_round_trip() -> None:
    rng = np.random.default_rng(4)
    model = nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 1))
    optimizer = optim.AdamW(model.parameters(), lr=0.01)
    x = ag.tensor(rng.standard_normal((8, 3)), dtype="float32")

    def train_step(net: nn.Module, opt: optim.Optimizer) -> None:
        opt.zero_grad()
        (net(x) ** 2).mean().backward_sync()
        opt.step()

    train_step(model, optimizer)
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    resumed = nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 1))
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer = optim.AdamW(resumed.parameters(), lr=0.01)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    train_step(model, optimizer)
    train_step(resumed, resumed_optimizer)
    for mine, reference in zip(resumed.parameters(), model.parameters(), strict=True):
        assert_close(mine.detach(), reference.detach(), rtol=0, atol=0)


# ------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda p: optim.SGD(p, lr=-1.0), "Invalid learning rate"),
        (lambda p: optim.SGD(p, lr=0.1, momentum=-0.1), "Invalid momentum"),
        (lambda p: optim.SGD(p, lr=0.1, weight_decay=-1), "Invalid weight_decay"),
        (lambda p: optim.SGD(p, lr=0.1, nesterov=True), "Nesterov momentum requires"),
        (
            lambda p: optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
            "zero dampening",
        ),
        (lambda p: optim.Adam(p, betas=(1.0, 0.999)), "beta parameter at index 0"),
        (lambda p: optim.Adam(p, betas=(0.9, -0.1)), "beta parameter at index 1"),
        (lambda p: optim.Adam(p, eps=-1e-8), "Invalid epsilon"),
        (lambda p: optim.AdamW(p, lr=-0.1), "Invalid learning rate"),
        (lambda p: optim.SGD([], lr=0.1), "empty parameter list"),
        (lambda p: optim.SGD([p[0], p[0]], lr=0.1), "more than one parameter group"),
        (
            lambda p: optim.SGD([{"params": p}, {"params": p[:1]}], lr=0.1),
            "more than one parameter group",
        ),
        (lambda p: optim.SGD([p[0] * 2], lr=0.1), "non-leaf"),
    ],
)
def test_invalid_arguments_raise_value_error(
    factory: Callable[[list[Any]], optim.Optimizer], message: str
) -> None:
    params = make_params([np.ones(2)])
    with pytest.raises(ValueError, match=message):
        factory(params)


def test_invalid_params_types_raise_type_error() -> None:
    (param,) = make_params([np.ones(2)])
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        optim.SGD(param, lr=0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="can only optimize Tensors"):
        optim.SGD([np.ones(2)], lr=0.1)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="ordered collections"):
        optim.SGD([{"params": {param}}], lr=0.1)


def test_required_hyperparameter_must_be_given() -> None:
    class Custom(optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": optim.optimizer.required})

    (param,) = make_params([np.ones(2)])
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        Custom([param])
    assert Custom([{"params": [param], "lr": 0.5}]).param_groups[0]["lr"] == 0.5


def test_repr_lists_groups_and_hyperparameters() -> None:
    (param,) = make_params([np.ones(2)])
    text = repr(optim.SGD([param], lr=0.1, momentum=0.9))
    assert text.startswith("SGD (\nParameter Group 0\n")
    assert "    lr: 0.1\n" in text
    assert "    momentum: 0.9\n" in text
    assert text.endswith(")")


# ---------------------------------------------------------------------- training
def separable_problem(rng: np.random.Generator, count: int = 256) -> tuple[ag.Tensor, ag.Tensor]:
    """Two Gaussian blobs in 2-D, well apart, with labels 0 and 1 (float32 inputs)."""
    labels = rng.integers(0, 2, size=count)
    centres = np.array([[-1.5, -1.0], [1.5, 1.0]])
    points = centres[labels] + 0.6 * rng.standard_normal((count, 2))
    return ag.tensor(points, dtype="float32"), ag.tensor(labels, dtype="int64")


async def train_mlp(
    make_optimizer: Callable[[Any], optim.Optimizer], seed: int, steps: int = 60
) -> float:
    rng = np.random.default_rng(seed)
    inputs, labels = separable_problem(rng)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = make_optimizer(model.parameters())
    first_loss = None
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        first_loss = loss.item() if first_loss is None else first_loss
        await loss.backward()
        optimizer.step()
    with ag.no_grad():
        predictions = model(inputs).argmax(dim=1)
        final_loss = F.cross_entropy(model(inputs), labels).item()
    assert final_loss < first_loss
    return float((to_numpy(predictions) == to_numpy(labels)).mean())


TRAINING_CASES: list[tuple[str, Callable[[Any], optim.Optimizer]]] = [
    ("SGD", lambda params: optim.SGD(params, lr=0.1, momentum=0.9)),
    ("SGD-nesterov", lambda params: optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)),
    ("Adam", lambda params: optim.Adam(params, lr=0.05)),
    ("AdamW", lambda params: optim.AdamW(params, lr=0.05)),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "make_optimizer", [case[1] for case in TRAINING_CASES], ids=[c[0] for c in TRAINING_CASES]
)
async def test_mlp_training_reaches_high_accuracy(
    make_optimizer: Callable[[Any], optim.Optimizer],
) -> None:
    accuracy = await train_mlp(make_optimizer, seed=0)
    assert accuracy > 0.95


@pytest.mark.timeout(60)
async def test_concurrent_training_of_several_models_on_one_engine() -> None:
    """SPEC §5: N models trained at once with ``asyncio.gather`` on one engine."""
    accuracies = await asyncio.gather(
        *(
            train_mlp(make_optimizer, seed=seed)
            for seed, (_, make_optimizer) in enumerate(TRAINING_CASES)
        )
    )
    assert min(accuracies) > 0.95


async def test_training_on_device(device: str) -> None:
    rng = np.random.default_rng(5)
    inputs, labels = separable_problem(rng, count=64)
    inputs, labels = inputs.to(device), labels.to(device)
    model = nn.Sequential(nn.Linear(2, 8), nn.GELU(), nn.Linear(8, 2)).to(device)
    optimizer = optim.Adam(model.parameters(), lr=0.05, amsgrad=True)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        losses.append(loss.item())
        await loss.backward()
        optimizer.step()
    assert losses[-1] < 0.5 * losses[0]
    for param in model.parameters():
        assert str(param.device) == device
        assert str(optimizer.state[param]["exp_avg"].device) == device
