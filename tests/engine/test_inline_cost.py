"""The inline decision's per-node cost: element-wise nodes by their gradients' elements,
matrix products (matmul, linear) also by their flops, predicted from the shapes and held
equal to the flops of the products the node runs."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
import aioautograd.nn.functional as F
from aioautograd.autograd.node import PRICED, AccumulateGrad, Node
from aioautograd.engine import EnginePolicy, get_default_engine
from aioautograd.engine.inline import qualifies
from aioautograd.engine.ready_queue import NodeTask
from aioautograd.profiler import profile

UNBOUNDED = 1 << 40  # a limit that never decides


@pytest.fixture(autouse=True)
def generous_budget() -> Iterator[None]:
    """A budget that does not run out: what is checked is which nodes qualify, not how fast
    a loaded machine runs them."""
    engine = get_default_engine()
    saved = engine.inline_budget_s
    engine.inline_budget_s = 1.0
    yield
    engine.inline_budget_s = saved


def _verdict(task: NodeTask, max_elements: Any, max_flops: float) -> bool:
    return qualifies(task.node, task.inputs, max_elements, max_flops)


def _task(out: ag.Tensor) -> NodeTask:
    """The task that would run ``out``'s node with a gradient of ones."""
    graph_task: Any = SimpleNamespace(depth_key=0)  # (NodeTask reads only its depth key)
    return NodeTask(graph_task, out.grad_fn, [ag.ones(out.shape, dtype=out.dtype)])


def _measured_flops(node: Node, grad: ag.Tensor, monkeypatch: pytest.MonkeyPatch) -> int:
    """The floating-point operations of the matrix products ``node``'s backward runs."""
    # Every product of the built-in ops goes through its device's backend (the CPU one
    # computes a small product itself, a larger one through the CPU budget).
    backend = grad.device.backend
    product = backend.matmul
    flops = 0

    def counted(a: Any, b: Any) -> Any:
        nonlocal flops
        out = product(a, b)
        flops += 2 * max(out.size, 1) * a.shape[-1]
        return out

    def counted_pair(a1: Any, b1: Any, a2: Any, b2: Any) -> tuple[Any, Any]:
        return counted(a1, b1), counted(a2, b2)

    monkeypatch.setattr(backend, "matmul", counted)
    monkeypatch.setattr(backend, "matmul_pair", counted_pair)
    with ag.no_grad():
        node.apply([grad])
    monkeypatch.undo()
    return flops


def _randn(shape: tuple[int, ...], dtype: str, grad: bool) -> ag.Tensor:
    return ag.randn(*shape, dtype=dtype, requires_grad=grad)


PRICEDS: dict[str, Callable[[str], ag.Tensor]] = {
    "matmul": lambda dt: _randn((600, 64), dt, True) @ _randn((64, 64), dt, True),
    "matmul, b only": lambda dt: _randn((60, 7), dt, False) @ _randn((7, 9), dt, True),
    "matmul, a only": lambda dt: _randn((60, 7), dt, True) @ _randn((7, 9), dt, False),
    "batched": lambda dt: _randn((4, 6, 7), dt, True) @ _randn((4, 7, 5), dt, True),
    "broadcast b": lambda dt: _randn((4, 6, 7), dt, True) @ _randn((7, 5), dt, True),
    "broadcast batch": lambda dt: _randn((2, 3, 6, 7), dt, True) @ _randn((2, 1, 7, 5), dt, True),
    "integer a": lambda dt: ag.tensor(np.arange(42).reshape(6, 7)) @ _randn((7, 5), dt, True),
    "1-D a": lambda dt: _randn((7,), dt, True) @ _randn((7, 5), dt, True),
    "1-D b": lambda dt: _randn((3, 6, 7), dt, True) @ _randn((7,), dt, True),
    "linear": lambda dt: F.linear(
        _randn((600, 64), dt, True), _randn((64, 64), dt, True), _randn((64,), dt, True)
    ),
    "linear, no bias": lambda dt: F.linear(_randn((5, 6, 7), dt, True), _randn((3, 7), dt, True)),
    "linear, data input": lambda dt: F.linear(
        _randn((600, 2), dt, False), _randn((64, 2), dt, True), _randn((64,), dt, True)
    ),
    "linear, frozen weight": lambda dt: F.linear(
        _randn((30, 8), dt, True), _randn((5, 8), dt, False), _randn((5,), dt, True)
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(PRICEDS))
def test_a_products_predicted_flops_are_the_flops_it_runs(
    case: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = PRICEDS[case](dtype)
    assert out.grad_fn._plain == PRICED, out.grad_fn
    task = _task(out)
    flops = _measured_flops(out.grad_fn, task.inputs[0], monkeypatch)  # type: ignore[arg-type]
    assert flops > 0
    cost = flops * (1 if out.data.dtype == np.float32 else 2)  # in float32 operations
    assert _verdict(task, UNBOUNDED, cost)
    assert not _verdict(task, UNBOUNDED, cost - 1)


def test_a_products_elements_count_too() -> None:
    # An outer product: few flops per element, its (large) gradients decide.
    a = ag.randn(512, 1, requires_grad=True)
    b = ag.randn(1, 512, requires_grad=True)
    task = _task(a @ b)
    elements = 512 * 512 + 512 + 512
    assert _verdict(task, elements, UNBOUNDED)
    assert not _verdict(task, elements - 1, UNBOUNDED)


def test_dtypes_without_a_blas_kernel_cost_more_per_flop() -> None:
    costs = {}
    for dtype in ("float32", "float64", "float16"):
        out = _randn((8, 4), dtype, True) @ _randn((4, 3), dtype, True)
        task = _task(out)
        flops = 2 * 2 * 8 * 3 * 4  # two products of 2 * |grad| * k
        costs[dtype] = next(
            weight
            for weight in (1, 2, 256)
            if _verdict(task, UNBOUNDED, flops * weight)
            and not _verdict(task, UNBOUNDED, flops * weight - 1)
        )
    assert costs == {"float32": 1, "float64": 2, "float16": 256}


def test_element_wise_nodes_are_priced_by_elements_only() -> None:
    x = ag.randn(600, 64, requires_grad=True)
    task = _task(x.relu())
    assert task.node._plain != PRICED
    assert _verdict(task, 2 * 600 * 64, 0)  # no product: the flop limit does not apply
    assert not _verdict(task, 2 * 600 * 64 - 1, UNBOUNDED)


DEAR: dict[str, tuple[Callable[[ag.Tensor], ag.Tensor], int]] = {
    "gelu": (lambda x: F.gelu(x), 64),
    "gelu tanh": (lambda x: F.gelu(x, approximate="tanh"), 64),  # (the same node class)
    "sin": (lambda x: x.sin(), 8),
    "cos": (lambda x: x.cos(), 8),
    "var": (lambda x: x.var(-1), 8),
    "logsumexp": (lambda x: x.logsumexp(-1), 8),
    "tensor exponent": (lambda x: (x * x + 0.5) ** x, 8),
    "index": (lambda x: x[ag.tensor(np.array([3, 1, 3, 0]))], 4),
    "gather": (lambda x: x.gather(1, ag.tensor(np.zeros((12, 3), np.int64))), 4),
    "index_select": (lambda x: x.index_select(0, ag.tensor(np.array([2, 2, 5]))), 4),
    "embedding": (lambda x: F.embedding(ag.tensor(np.array([[1, 4], [4, 0]])), x), 4),
    "maximum": (lambda x: ag.maximum(x, x * 0.5), 2),
    "cumsum": (lambda x: x.cumsum(-1), 2),
    "norm": (lambda x: x.norm(dim=-1), 2),
    "relu": (lambda x: x.relu(), 1),
    "exp": (lambda x: x.exp(), 1),
    "scalar base": (lambda x: 2.0**x, 1),
}


@pytest.mark.parametrize("case", list(DEAR))
def test_dear_element_wise_nodes_count_each_element_several_times(case: str) -> None:
    op, weight = DEAR[case]
    x = ag.randn(12, 5, dtype="float64", requires_grad=True)
    out = op(x)
    task = _task(out)
    # What it reads and writes: its gradient, and one of x's shape per operand.
    elements = out.data.size + x.data.size * len(task.node.next_functions)
    assert (task.node._plain == PRICED) == (weight != 1)
    assert _verdict(task, elements * weight, 0)
    assert not _verdict(task, elements * weight - 1, 0)


async def test_a_gelu_backward_that_a_relu_of_its_size_would_run_inline_goes_out() -> None:
    x = ag.randn(64, 64, dtype="float64", requires_grad=True)
    here = threading.current_thread().name
    for op, inline in ((F.relu, True), (F.gelu, False)):
        with profile() as prof:
            await op(x).sum().backward()
        threads = _threads_by_node(prof)
        assert threads["SumBackward0"] == {here}, threads
        ran_here = {here} == threads["GeluBackward0" if op is F.gelu else "ReluBackward0"]
        assert ran_here == inline, threads


def test_a_retained_products_output_is_still_priced_by_flops() -> None:
    # retain_grad takes the node off the plain fast path; its price stays the products'.
    a = ag.randn(64, 64, requires_grad=True)
    b = ag.randn(64, 64, requires_grad=True)
    out = a @ b
    out.retain_grad()
    assert out.grad_fn._plain == 0
    task = _task(out)
    flops = 2 * 2 * 64 * 64 * 64
    assert _verdict(task, UNBOUNDED, flops)
    assert not _verdict(task, UNBOUNDED, flops - 1)
    hooked = a @ b
    hooked.grad_fn.register_hook(lambda grads_in, grads_out: None)
    assert not _verdict(_task(hooked), UNBOUNDED, UNBOUNDED)  # user code: executors


def test_the_default_policy_takes_a_600x64_layer_and_not_the_mlp_layers() -> None:
    policy = EnginePolicy()

    def verdict(rows: int, inputs: int, outputs: int, dtype: str = "float32") -> bool:
        x = ag.randn(rows, inputs, dtype=dtype, requires_grad=True)
        w = ag.randn(outputs, inputs, dtype=dtype, requires_grad=True)
        b = ag.randn(outputs, dtype=dtype, requires_grad=True)
        task = _task(F.linear(x, w, b))
        return _verdict(task, policy.inline_max_elements, policy.inline_max_flops)

    assert verdict(600, 64, 64)  # the model-parallel step's hidden layer: 9.8 MFLOP
    assert not verdict(600, 64, 64, "float64")  # the same in float64 costs twice as much
    assert not verdict(209, 209, 209)  # 36.5 MFLOP in 131,252 elements
    assert not verdict(256, 1024, 1024)  # the mlp step's hidden layer
    assert not verdict(64, 256, 256)  # concurrent_mid's hidden layer: 16.8 MFLOP


def _stage(dtype: str, hidden: int) -> tuple[list[ag.Tensor], ag.Tensor]:
    """The model-parallel example's shapes: 600 points, 2 -> hidden -> hidden -> 3."""
    rng = np.random.default_rng(7)
    params = [
        ag.tensor(rng.standard_normal(shape) * 0.3, dtype=dtype, requires_grad=True)
        for shape in ((hidden, 2), (hidden,), (hidden, hidden), (hidden,), (3, hidden), (3,))
    ]
    points = ag.tensor(rng.standard_normal((600, 2)), dtype=dtype)
    h = F.linear(points, params[0], params[1]).relu()
    h = F.linear(h, params[2], params[3]).relu()
    return params, (F.linear(h, params[4], params[5]) ** 2).mean()


def _threads_by_node(prof: profile) -> dict[str, set[str]]:
    threads: dict[str, set[str]] = {}
    for event in prof.events:
        threads.setdefault(event.name, set()).add(event.thread)
    return threads


async def test_a_600x64_pass_runs_on_the_loop() -> None:
    params, loss = _stage("float32", 64)
    with profile() as prof:
        await loss.backward()
    here = threading.current_thread().name
    threads = _threads_by_node(prof)
    assert "LinearFunctionBackward0" in threads
    assert all(ran == {here} for ran in threads.values()), threads
    assert all(p.grad is not None for p in params)


@pytest.mark.parametrize(("dtype", "hidden"), [("float32", 96), ("float64", 64)])
async def test_a_large_product_stays_off_the_loop(dtype: str, hidden: int) -> None:
    # float32 600x96x96: 22 MFLOP in 124,512 elements (its elements would qualify);
    # float64 600x64x64: 9.8 MFLOP at twice the cost.
    _, loss = _stage(dtype, hidden)
    with profile() as prof:
        await loss.backward()
    here = threading.current_thread().name
    by_order = [(event.name, event.thread) for event in sorted(prof.events, key=_start)]
    # The loss's nodes and the last layer's (small) product ran here; the hidden layer's
    # product, and everything after it, on the executors.
    first_off = next(i for i, (_, thread) in enumerate(by_order) if thread != here)
    assert by_order[0][1] == here, by_order
    assert by_order[first_off][0] in ("LinearFunctionBackward0", "ReluBackward0"), by_order
    assert all(thread.startswith("aioautograd-cpu") for _, thread in by_order[first_off:])
    hidden_layers = [i for i, (name, _) in enumerate(by_order) if name == "LinearFunctionBackward0"]
    assert len(hidden_layers) == 3
    assert by_order[hidden_layers[1]][1] != here, by_order


def _start(event: Any) -> int:
    return int(event.start_ns)


@pytest.mark.parametrize(("dtype", "hidden"), [("float32", 64), ("float32", 96), ("float64", 64)])
async def test_gradients_are_bitwise_those_of_the_executors(dtype: str, hidden: int) -> None:
    engine = get_default_engine()
    grads = []
    for budget in (1.0, 0.0):
        engine.inline_budget_s = budget
        params, loss = _stage(dtype, hidden)
        with profile() as prof:
            await loss.backward()
        inline = {event.thread for event in prof.events} == {threading.current_thread().name}
        assert inline == (budget > 0 and dtype == "float32" and hidden == 64)
        grads.append([p.grad.data.copy() for p in params])  # type: ignore[union-attr]
    for inline_grad, executor_grad in zip(*grads, strict=True):
        assert inline_grad.dtype == executor_grad.dtype
        assert np.array_equal(inline_grad, executor_grad)


def _uncounted_verdict(task: NodeTask, max_elements: Any, max_flops: float) -> bool:
    """The verdict with the node's count at creation set aside: read from the gradients and
    the edges, as for a node made elsewhere than ``Function.apply``."""
    node: Any = task.node
    counted = node._elements
    node._elements = -1
    try:
        return _verdict(task, max_elements, max_flops)
    finally:
        node._elements = counted


COUNTED: dict[str, Callable[[], ag.Tensor]] = {
    "relu": lambda: ag.randn(7, 5, requires_grad=True).relu(),
    "add, broadcast bias": lambda: (
        ag.randn(8, 6, requires_grad=True) + ag.randn(6, requires_grad=True)
    ),
    "add, one operand data": lambda: ag.randn(8, 6) + ag.randn(6, requires_grad=True),
    "mul by a number": lambda: ag.randn(4, 3, requires_grad=True) * 2.0,
    "chained": lambda: (ag.randn(4, 3, requires_grad=True) * 2.0).exp(),
    "sum": lambda: ag.randn(9, 4, requires_grad=True).sum(),
    "cross_entropy": lambda: F.cross_entropy(
        ag.randn(8, 10, requires_grad=True), ag.tensor(np.arange(8) % 10)
    ),
    "split (several outputs)": lambda: ag.randn(6, 4, requires_grad=True).split(2)[1],
    "gelu": lambda: F.gelu(ag.randn(5, 5, dtype="float64", requires_grad=True)),
    **{f"product: {name}": functools.partial(make, "float32") for name, make in PRICEDS.items()},
}


@pytest.mark.parametrize("case", list(COUNTED))
def test_the_count_made_at_creation_is_the_one_read_at_backward(case: str) -> None:
    out = COUNTED[case]()
    node: Any = out.grad_fn
    assert node._elements >= 0, "a CPU node of Function.apply is counted at creation"
    # Every gradient the node reads arrives (a split's other pieces too).
    grads = [ag.ones(shape, dtype=dtype) for shape, dtype, _ in node._input_metadata]
    task = NodeTask(SimpleNamespace(depth_key=0), node, grads)  # type: ignore[arg-type]
    # The count it was given: what the gradients it reads and writes hold.
    outputs = sum(math.prod(shape) for shape, _, device in node._input_metadata if device)
    written = sum(
        next_node.variable.data.size
        if type(next_node) is AccumulateGrad
        else math.prod(next_node._input_metadata[input_nr][0])
        for next_node, input_nr in node.next_functions
        if next_node is not None
    )
    assert node._elements == outputs + written
    weight = node._element_cost
    for limit in (node._elements * weight, node._elements * weight - 1):
        for flops in (UNBOUNDED, 0, 1 << 12):
            assert _verdict(task, limit, flops) == _uncounted_verdict(task, limit, flops), (
                limit,
                flops,
            )


def test_a_node_with_a_gradient_off_the_cpu_is_not_counted_and_stays_off_the_loop() -> None:
    x = ag.randn(4, 3, dtype="float64", device="sim:0", requires_grad=True)
    for out in (x.relu(), x @ ag.randn(3, 2, dtype="float64", device="sim:0")):
        node: Any = out.grad_fn
        assert node._elements < 0
        task = NodeTask(SimpleNamespace(depth_key=0), node, [ag.ones_like(out)])  # type: ignore[arg-type]
        assert not _verdict(task, UNBOUNDED, UNBOUNDED)
    # A copy to the CPU: its gradient arrives on the CPU, the one it writes is x's.
    copied = x.to("cpu")
    copy_node: Any = copied.grad_fn
    assert copy_node._elements == 2 * x.data.size


def test_a_gradient_that_does_not_arrive_is_counted_all_the_same() -> None:
    # The count made at creation is an upper bound: it can only keep a node off the loop.
    pieces = ag.randn(6, 4, requires_grad=True).split(2)
    node: Any = pieces[1].grad_fn
    task = NodeTask(SimpleNamespace(depth_key=0), node, [None, ag.ones(2, 4), None])  # type: ignore[arg-type]
    read_and_written = 8 + 24
    assert node._elements == 24 + 24
    assert _uncounted_verdict(task, read_and_written, 0)
    assert not _verdict(task, read_and_written, 0)
    assert _verdict(task, node._elements, 0)
