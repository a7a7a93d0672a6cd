"""Benchmark workloads: one `Workload` per figure of spec §8, one `Impl` per implementation.

A workload is data: its sizes (``full``, ``quick``, ``tiny``), its repeat counts and the
implementations that compute the same thing. Each implementation is a factory that builds a
`Case` for given parameters; the harness in ``run.py`` calls ``case.prepare()`` outside the
timed region (building the graph for backward-only figures, dropping old gradients) and times
``case.run()``, a plain function or a coroutine function that returns the loss (or a checksum),
so that every repeat can be checked for a finite result.

Adding a figure is one more ``register(Workload(...))`` call; a case may
also define ``extras()`` to add fields to its JSON line, and a workload a ``summary`` with a
table of its own. The concurrent-training and event-loop-stall figures live in
``benchmarks/concurrency.py``, the distributed model-parallel step in
``benchmarks/distributed.py``; both register themselves when this module is imported. A case
that holds resources between runs (worker processes) releases them in ``close()``.

torch, HIPS autograd and mygrad are imported inside their factories only, so this module loads
with nothing but NumPy and aioautograd installed; ``Impl.needs`` names the modules an
implementation imports, and the harness skips it cleanly when one is missing.
"""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import aioautograd as ag

Params = dict[str, Any]


class Case:
    """One implementation of one workload at one size, ready to be timed."""

    # Backward nodes the timed region runs through (ops, not counting AccumulateGrad), for
    # the ``per_node_us`` field; ``None`` where a per-node figure means nothing (MLP steps).
    nodes: int | None = None
    # Set by ``run()`` when the case times its own region (the stall cases time only the
    # backward, not the heartbeat around it); the harness then records it instead.
    timed_s: float | None = None

    def prepare(self) -> None:
        """Untimed set-up before each repeat (build the graph, drop old gradients)."""

    def run(self) -> float | Awaitable[float]:
        """The timed region; returns the loss (or a checksum) of this repeat."""
        raise NotImplementedError

    def extras(self) -> dict[str, Any]:
        """Extra fields for this case's JSON line."""
        return {}

    def begin_timed(self) -> None:
        """Called after the warm-up runs: statistics kept for ``extras()`` start here."""

    def kept(self) -> None:
        """Called after each run whose time the harness keeps (not after a warm-up run, nor
        after an interleaved round's re-warming one)."""

    def close(self) -> None:
        """Called after the case's last run: release what it holds (worker processes).
        May be called again; a closed case is not run again."""


@dataclass(frozen=True)
class Impl:
    name: str
    factory: Callable[[Params], Case]
    needs: tuple[str, ...] = ()  # importable modules this implementation uses
    # False for a variant shown only in its workload's summary table, not as a column of
    # the main tables (e.g. sequential training with one BLAS thread).
    main_table: bool = True
    # Optional check run when every module in ``needs`` is there: why this implementation
    # cannot run here (e.g. a torch build without ``torch.distributed.rpc``), or ``None``.
    unavailable: Callable[[], str | None] | None = None

    def missing(self) -> list[str]:
        return [name for name in self.needs if importlib.util.find_spec(name) is None]

    def skip_reason(self) -> str | None:
        """Why the harness skips this implementation here, or ``None`` if it can run."""
        missing = self.missing()
        if missing:
            return f"missing {missing}"
        return None if self.unavailable is None else self.unavailable()


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    sizes: dict[str, Params]  # "full", "quick" and "tiny" (the smoke test's)
    repeats: dict[str, tuple[int, int]]  # size -> (warm-up, timed repeats)
    impls: tuple[Impl, ...] = field(default=())
    # Optional: the JSON lines of the run (implementation -> line) -> a JSON summary and a
    # markdown table of its own, printed after the main tables.
    summary: Callable[[dict[str, dict[str, Any]]], tuple[dict[str, Any], str]] | None = None


REGISTRY: dict[str, Workload] = {}

SUBJECT = "aioautograd"  # the implementation every ratio is taken of


def register(workload: Workload) -> Workload:
    if workload.name in REGISTRY:
        raise ValueError(f"workload {workload.name!r} registered twice")
    REGISTRY[workload.name] = workload
    return workload


def tree_sum(terms: list[Any]) -> Any:
    """Sum of ``terms`` as a balanced tree of ``+``: the branches stay independent."""
    while len(terms) > 1:
        paired = [terms[i] + terms[i + 1] for i in range(0, len(terms) - 1, 2)]
        if len(terms) % 2:
            paired.append(terms[-1])
        terms = paired
    return terms[0]


def _seed_array(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------------ chain
# h = h * c, n times, on a 4-element float32 tensor, then h.sum(); only backward is timed.

CHAIN_FACTOR = 1.0001


class _AioChain(Case):
    def __init__(self, params: Params) -> None:
        self.n = params["n"]
        self.nodes = self.n + 1
        self.x = ag.tensor(_seed_array((4,)), requires_grad=True)

    def prepare(self) -> None:
        self.x.grad = None
        h = self.x
        for _ in range(self.n):
            h = h * CHAIN_FACTOR
        self.loss = h.sum()

    async def run(self) -> float:
        await self.loss.backward()
        return float(self.x.grad.numpy().sum())


class _TorchChain(Case):
    def __init__(self, params: Params) -> None:
        import torch

        self.n = params["n"]
        self.nodes = self.n + 1
        self.x = torch.tensor(_seed_array((4,)), requires_grad=True)

    def prepare(self) -> None:
        self.x.grad = None
        h = self.x
        for _ in range(self.n):
            h = h * CHAIN_FACTOR
        self.loss = h.sum()

    def run(self) -> float:
        self.loss.backward()
        return float(self.x.grad.sum())


class _HipsChain(Case):
    """HIPS autograd traces forward in ``make_vjp``; calling the vjp is its backward pass."""

    def __init__(self, params: Params) -> None:
        self.n = params["n"]
        self.nodes = self.n + 1
        self.x = _seed_array((4,))

    def prepare(self) -> None:
        import autograd.numpy as anp
        from autograd.core import make_vjp

        def f(x: Any) -> Any:
            h = x
            for _ in range(self.n):
                h = h * CHAIN_FACTOR
            return anp.sum(h)

        self.vjp, _ = make_vjp(f, self.x)

    def run(self) -> float:
        return float(np.sum(self.vjp(np.float32(1.0))))


class _MygradChain(Case):
    def __init__(self, params: Params) -> None:
        import mygrad as mg

        self.mg = mg
        self.n = params["n"]
        self.nodes = self.n + 1
        self.x = mg.tensor(_seed_array((4,)))

    def prepare(self) -> None:
        self.x.null_grad()
        h = self.x
        for _ in range(self.n):
            h = h * CHAIN_FACTOR
        self.loss = self.mg.sum(h)

    def run(self) -> float:
        self.loss.backward()
        return float(np.sum(self.x.grad))


register(
    Workload(
        name="chain",
        description="backward of a chain of n tiny ops (h = h * 1.0001 on 4 floats), per node",
        sizes={"full": {"n": 10_000}, "quick": {"n": 2_000}, "tiny": {"n": 10}},
        repeats={"full": (3, 30), "quick": (1, 5), "tiny": (0, 1)},
        impls=(
            Impl("aioautograd", _AioChain),
            Impl("torch", _TorchChain, ("torch",)),
            Impl("autograd", _HipsChain, ("autograd",)),
            Impl("mygrad", _MygradChain, ("mygrad",)),
        ),
    )
)


# ---------------------------------------------------------------------------- chain_forward
# The chain's forward, recording the graph: h = h * c, n times, then sum; per op. The graph
# built by a run is kept until the next prepare(), so that freeing it is not timed.


class _ChainForward(Case):
    """``h = x * c`` n times, then the library's sum (kept in ``result``); subclasses set
    ``x`` (a tensor of their library) and, where ``sum`` is not a method, ``total``."""

    x: Any

    def __init__(self, params: Params) -> None:
        self.n = params["n"]
        self.nodes = self.n + 1
        self.result: Any = None

    def prepare(self) -> None:
        self.result = None

    def total(self, h: Any) -> Any:
        return h.sum()

    def run(self) -> float:
        h = self.x
        for _ in range(self.n):
            h = h * CHAIN_FACTOR
        self.result = self.total(h)
        return float(self.result.item())


class _AioChainForward(_ChainForward):
    def __init__(self, params: Params) -> None:
        super().__init__(params)
        self.x = ag.tensor(_seed_array((4,)), requires_grad=True)


class _TorchChainForward(_ChainForward):
    def __init__(self, params: Params) -> None:
        import torch

        super().__init__(params)
        self.x = torch.tensor(_seed_array((4,)), requires_grad=True)


class _HipsChainForward(_ChainForward):
    """HIPS autograd's forward is the trace ``make_vjp`` records (its vjp is kept)."""

    def __init__(self, params: Params) -> None:
        import autograd.numpy as anp
        from autograd.core import make_vjp

        super().__init__(params)
        self.x = _seed_array((4,))
        self.make_vjp = make_vjp

        def f(x: Any) -> Any:
            h = x
            for _ in range(self.n):
                h = h * CHAIN_FACTOR
            return anp.sum(h)

        self.f = f

    def run(self) -> float:
        self.result = self.make_vjp(self.f, self.x)
        return float(self.result[1])


class _MygradChainForward(_ChainForward):
    def __init__(self, params: Params) -> None:
        import mygrad as mg

        super().__init__(params)
        self.mg = mg
        self.x = mg.tensor(_seed_array((4,)))

    def total(self, h: Any) -> Any:
        return self.mg.sum(h)


class _NumpyChainForward(_ChainForward):
    def __init__(self, params: Params) -> None:
        super().__init__(params)
        self.x = _seed_array((4,))

    def total(self, h: Any) -> Any:
        return np.sum(h)


register(
    Workload(
        name="chain_forward",
        description="forward of the chain (h = h * 1.0001, n times, recording the graph), per op",
        sizes={"full": {"n": 10_000}, "quick": {"n": 2_000}, "tiny": {"n": 10}},
        repeats={"full": (3, 30), "quick": (1, 5), "tiny": (0, 1)},
        impls=(
            Impl("aioautograd", _AioChainForward),
            Impl("torch", _TorchChainForward, ("torch",)),
            Impl("numpy", _NumpyChainForward),
            Impl("autograd", _HipsChainForward, ("autograd",)),
            Impl("mygrad", _MygradChainForward, ("mygrad",)),
        ),
    )
)


# -------------------------------------------------------------------------------------- fan
# x (4 floats) -> branches x * c_i -> balanced tree of adds -> sum; only backward is timed.
# 2 * branches ops: `branches` muls, `branches - 1` adds, one sum; x's gradient buffer
# receives `branches` contributions.


def _fan_factors(branches: int) -> list[float]:
    return [1.0 + 1e-4 * i for i in range(branches)]


class _AioFan(Case):
    def __init__(self, params: Params) -> None:
        self.factors = _fan_factors(params["branches"])
        self.nodes = 2 * params["branches"]
        self.x = ag.tensor(_seed_array((4,)), requires_grad=True)

    def prepare(self) -> None:
        self.x.grad = None
        self.loss = tree_sum([self.x * c for c in self.factors]).sum()

    async def run(self) -> float:
        await self.loss.backward()
        return float(self.x.grad.numpy().sum())


class _TorchFan(Case):
    def __init__(self, params: Params) -> None:
        import torch

        self.factors = _fan_factors(params["branches"])
        self.nodes = 2 * params["branches"]
        self.x = torch.tensor(_seed_array((4,)), requires_grad=True)

    def prepare(self) -> None:
        self.x.grad = None
        self.loss = tree_sum([self.x * c for c in self.factors]).sum()

    def run(self) -> float:
        self.loss.backward()
        return float(self.x.grad.sum())


class _HipsFan(Case):
    def __init__(self, params: Params) -> None:
        self.factors = _fan_factors(params["branches"])
        self.nodes = 2 * params["branches"]
        self.x = _seed_array((4,))

    def prepare(self) -> None:
        import autograd.numpy as anp
        from autograd.core import make_vjp

        def f(x: Any) -> Any:
            return anp.sum(tree_sum([x * c for c in self.factors]))

        self.vjp, _ = make_vjp(f, self.x)

    def run(self) -> float:
        return float(np.sum(self.vjp(np.float32(1.0))))


class _MygradFan(Case):
    def __init__(self, params: Params) -> None:
        import mygrad as mg

        self.mg = mg
        self.factors = _fan_factors(params["branches"])
        self.nodes = 2 * params["branches"]
        self.x = mg.tensor(_seed_array((4,)))

    def prepare(self) -> None:
        self.x.null_grad()
        self.loss = self.mg.sum(tree_sum([self.x * c for c in self.factors]))

    def run(self) -> float:
        self.loss.backward()
        return float(np.sum(self.x.grad))


class _AioFanChainPairs(Case):
    """The fan and the chain (``chain``'s size) timed back to back in every repeat, each
    pair's order alternating: the per-pair ratio fan / chain (per node) compares two
    backward passes taken within ~0.1 s of each other, where the ratio of the two
    workloads' medians compares runs taken minutes apart, on a VM whose speed drifts. The
    repeat's own figure is the fan's backward."""

    def __init__(self, params: Params) -> None:
        self.fan = _AioFan(params)
        self.chain = _AioChain({"n": params["chain"]})
        self.nodes = self.fan_nodes = 2 * params["branches"]
        self.chain_nodes = params["chain"] + 1
        self.pairs: list[tuple[float, float]] = []  # (fan, chain) seconds per node
        self.last = (0.0, 0.0)
        self.flip = False

    def prepare(self) -> None:
        self.fan.prepare()
        self.chain.prepare()

    async def run(self) -> float:
        timed: dict[str, float] = {}
        self.flip = not self.flip
        order = (self.fan, self.chain) if self.flip else (self.chain, self.fan)
        value = 0.0
        for case in order:
            start = time.perf_counter()
            result = await case.run()
            timed["fan" if case is self.fan else "chain"] = time.perf_counter() - start
            if case is self.fan:
                value = result
        self.last = (timed["fan"] / self.fan_nodes, timed["chain"] / self.chain_nodes)
        self.timed_s = timed["fan"]
        return value

    def kept(self) -> None:
        self.pairs.append(self.last)

    def extras(self) -> dict[str, Any]:
        if not self.pairs:
            return {}
        ratios = [fan / chain for fan, chain in self.pairs]
        return {
            "pairs": len(self.pairs),
            "pair_fan_median_us": round(statistics.median(f for f, _ in self.pairs) * 1e6, 3),
            "pair_chain_median_us": round(statistics.median(c for _, c in self.pairs) * 1e6, 3),
            "pair_ratio_median": round(statistics.median(ratios), 3),
            "pair_ratio_min": round(min(ratios), 3),
            "pair_ratio_max": round(max(ratios), 3),
            "pairs_within_1_5x": sum(r <= 1.5 for r in ratios),
        }


def _fan_summary(lines: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The paired fan / chain ratio (``aioautograd-paired``), when that variant ran, beside
    every implementation's fan figure per node."""
    summary: dict[str, Any] = {}
    rows = [
        "| implementation | median µs/node | min µs/node | pairs | pair fan / chain µs/node "
        "(medians) | median of pair ratios (min-max) | pairs ≤ 1.5x |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, line in lines.items():
        nodes = line["nodes"]
        entry: dict[str, Any] = {
            "median_us": round(line["median_s"] / nodes * 1e6, 3),
            "min_us": round(line["min_s"] / nodes * 1e6, 3),
        }
        cells = [f"{entry['median_us']:.3g}", f"{entry['min_us']:.3g}", "—", "—", "—", "—"]
        if "pair_ratio_median" in line:
            entry.update({k: v for k, v in line.items() if k.startswith("pair")})
            cells[2:] = [
                str(line["pairs"]),
                f"{line['pair_fan_median_us']:.3g} / {line['pair_chain_median_us']:.3g}",
                f"{line['pair_ratio_median']:.2f}x ({line['pair_ratio_min']:.2f}-"
                f"{line['pair_ratio_max']:.2f})",
                f"{line['pairs_within_1_5x']} of {line['pairs']}",
            ]
        summary[name] = entry
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return summary, "\n".join(rows)


register(
    Workload(
        name="fan",
        description="backward of x -> n branches (x * c_i) -> balanced tree of adds -> sum",
        # ``chain``: the chain's length in the ``aioautograd-paired`` variant (the ``chain``
        # workload's sizes)
        sizes={
            "full": {"branches": 1_000, "chain": 10_000},
            "quick": {"branches": 1_000, "chain": 2_000},
            "tiny": {"branches": 8, "chain": 10},
        },
        repeats={"full": (3, 50), "quick": (1, 10), "tiny": (0, 1)},
        summary=_fan_summary,
        impls=(
            Impl("aioautograd", _AioFan),
            Impl(f"{SUBJECT}-paired", _AioFanChainPairs, main_table=False),
            Impl("torch", _TorchFan, ("torch",)),
            Impl("autograd", _HipsFan, ("autograd",)),
            Impl("mygrad", _MygradFan, ("mygrad",)),
        ),
    )
)


# chain_long: the same backward over 100,000 nodes, whose per-node cost should stay flat.
register(
    Workload(
        name="chain_long",
        description="the chain's backward over 100,000 nodes (per node: flat growth vs chain)",
        sizes={"full": {"n": 100_000}, "quick": {"n": 100_000}, "tiny": {"n": 10}},
        repeats={"full": (1, 7), "quick": (1, 3), "tiny": (0, 1)},
        impls=(
            Impl("aioautograd", _AioChain),
            Impl("torch", _TorchChain, ("torch",)),
            Impl("autograd", _HipsChain, ("autograd",)),
            Impl("mygrad", _MygradChain, ("mygrad",)),
        ),
    )
)


# -------------------------------------------------------------------------------------- MLP
# One SGD training step: forward, softmax cross-entropy (mean over the batch), backward,
# p -= lr * grad, gradients dropped (PyTorch's zero_grad(set_to_none=True)). All three
# implementations start from the same float32 weights and batch.

LEARNING_RATE = 0.01


@dataclass
class MlpData:
    weights: list[np.ndarray]  # W1, W2, ..., each (fan_in, fan_out)
    biases: list[np.ndarray]
    inputs: np.ndarray  # (batch, widths[0])
    targets: np.ndarray  # (batch,) int64 class indices
    one_hot: np.ndarray  # (batch, classes) float32


def mlp_data(widths: list[int], batch: int, seed: int = 0) -> MlpData:
    rng = np.random.default_rng(seed)
    weights, biases = [], []
    for fan_in, fan_out in itertools.pairwise(widths):
        scale = np.sqrt(2.0 / fan_in)  # He initialisation, for ReLU layers
        weights.append((rng.standard_normal((fan_in, fan_out)) * scale).astype(np.float32))
        biases.append(np.zeros(fan_out, np.float32))
    inputs = rng.standard_normal((batch, widths[0])).astype(np.float32)
    targets = rng.integers(0, widths[-1], batch).astype(np.int64)
    one_hot = np.zeros((batch, widths[-1]), np.float32)
    one_hot[np.arange(batch), targets] = 1.0
    return MlpData(weights, biases, inputs, targets, one_hot)


class _LogSoftmax(ag.Function):
    """Row-wise log-softmax, used only while aioautograd lacks log / max / log_softmax."""

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        data = x.data
        shifted = data - data.max(axis=1, keepdims=True)
        out = ag.from_numpy(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
        (out,) = ctx.saved_tensors
        return grad - out.exp() * grad.sum(1, keepdim=True)


def _works(fn: Callable[[], Any]) -> bool:
    try:
        fn()
    except (AttributeError, NotImplementedError, TypeError):
        return False
    return True


def aio_relu() -> tuple[Callable[[ag.Tensor], ag.Tensor], str]:
    """``Tensor.relu`` when aioautograd has it, else ``maximum(x, 0)``; and which one."""
    probe = ag.zeros(2, 3, requires_grad=True)
    if _works(lambda: probe.relu()):
        return (lambda x: x.relu()), "Tensor.relu"
    return (lambda x: ag.maximum(x, 0.0)), "maximum(x, 0)"


def aio_cross_entropy() -> tuple[Callable[[ag.Tensor, ag.Tensor, ag.Tensor], ag.Tensor], str]:
    """The best cross-entropy aioautograd offers now; and which one.

    The returned function takes ``(logits, targets, one_hot)``: class indices for
    ``nn.functional.cross_entropy``, the one-hot matrix for the log-softmax fallbacks.
    """
    probe = ag.zeros(2, 3, requires_grad=True)
    targets = ag.tensor(np.array([0, 2], np.int64))
    functional = ag.nn.functional
    if _works(lambda: functional.cross_entropy(probe, targets)):
        return (lambda z, t, _: functional.cross_entropy(z, t)), "nn.functional.cross_entropy"

    def nll(log_probs: ag.Tensor, one_hot: ag.Tensor) -> ag.Tensor:
        return -(log_probs * one_hot).sum() / one_hot.shape[0]

    if _works(lambda: probe.log_softmax(1)):
        return (lambda z, _, h: nll(z.log_softmax(1), h)), "Tensor.log_softmax + one-hot NLL"
    return (
        lambda z, _, h: nll(_LogSoftmax.apply(z), h)
    ), "benchmark-local LogSoftmax Function + one-hot NLL"


def load_aio_mlp(case: Any, params: Params, device: str = "cpu") -> list[ag.Tensor]:
    """Set ``weights``, ``biases``, ``inputs``, ``targets``, ``one_hot`` on ``case`` as
    aioautograd tensors of the shared MLP data on ``device``; return the leaves (weights +
    biases)."""
    data = mlp_data(params["widths"], params["batch"], seed=params.get("seed", 0))
    case.weights = [ag.tensor(w, device=device, requires_grad=True) for w in data.weights]
    case.biases = [ag.tensor(b, device=device, requires_grad=True) for b in data.biases]
    case.inputs = ag.tensor(data.inputs, device=device)
    case.targets = ag.tensor(data.targets, device=device)
    case.one_hot = ag.tensor(data.one_hot, device=device)
    return [*case.weights, *case.biases]


class _AioMlp(Case):
    """The step on ``device`` (``loss.item()`` at its end waits for an accelerator)."""

    def __init__(self, params: Params, device: str = "cpu") -> None:
        self.params = load_aio_mlp(self, params, device)
        self.relu, self.relu_impl = aio_relu()
        self.cross_entropy, self.loss_impl = aio_cross_entropy()

    def forward_loss(self) -> ag.Tensor:
        """The step's forward pass and loss (``mlp_parts.py`` and ``gpu_profile.py`` time the
        step's parts around it)."""
        h = self.inputs
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = h @ w + b
            if i < last:
                h = self.relu(h)
        return self.cross_entropy(h, self.targets, self.one_hot)

    async def run(self) -> float:
        loss = self.forward_loss()
        await loss.backward()
        with ag.no_grad():
            for p in self.params:
                p.sub_(p.grad, alpha=LEARNING_RATE)
                p.grad = None
        return float(loss.item())

    def extras(self) -> dict[str, Any]:
        return {"relu": self.relu_impl, "loss": self.loss_impl}


class _TorchMlp(Case):
    """torch's step on ``device`` (``loss.item()`` at its end waits for CUDA)."""

    def __init__(self, params: Params, device: str = "cpu") -> None:
        import torch

        self.functional = torch.nn.functional
        self.no_grad = torch.no_grad
        data = mlp_data(params["widths"], params["batch"])
        self.weights = [torch.tensor(w, device=device, requires_grad=True) for w in data.weights]
        self.biases = [torch.tensor(b, device=device, requires_grad=True) for b in data.biases]
        self.params = self.weights + self.biases
        self.inputs = torch.tensor(data.inputs, device=device)
        self.targets = torch.tensor(data.targets, device=device)

    def run(self) -> float:
        functional = self.functional
        h = self.inputs
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = h @ w + b
            if i < last:
                h = functional.relu(h)
        loss = functional.cross_entropy(h, self.targets)
        loss.backward()
        with self.no_grad():
            for p in self.params:
                p.sub_(p.grad, alpha=LEARNING_RATE)
                p.grad = None
        return float(loss.item())

    def extras(self) -> dict[str, Any]:
        return {"relu": "F.relu", "loss": "F.cross_entropy"}


class _NumpyMlp(Case):
    """Hand-written forward and backward: the engine-free floor on the same BLAS."""

    def __init__(self, params: Params) -> None:
        data = mlp_data(params["widths"], params["batch"])
        self.weights = data.weights
        self.biases = data.biases
        self.inputs = data.inputs
        self.targets = data.targets
        self.rows = np.arange(params["batch"])

    def run(self) -> float:
        weights, biases = self.weights, self.biases
        batch = self.inputs.shape[0]
        # Forward; activations[i] is the input of layer i.
        activations = [self.inputs]
        h = self.inputs
        last = len(weights) - 1
        for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
            h = h @ w
            h += b
            if i < last:
                np.maximum(h, 0.0, out=h)
                activations.append(h)
        logits = h
        # Softmax cross-entropy, mean over the batch.
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        norm = probs.sum(axis=1, keepdims=True)
        loss = float(np.log(norm[:, 0]).mean() - logits[self.rows, self.targets].mean())
        # Backward: d(loss)/d(logits) = (softmax - one_hot) / batch.
        probs /= norm
        probs[self.rows, self.targets] -= 1.0
        probs /= batch
        grad = probs
        weight_grads: list[np.ndarray] = [None] * len(weights)  # type: ignore[list-item]
        bias_grads: list[np.ndarray] = [None] * len(weights)  # type: ignore[list-item]
        for i in range(last, -1, -1):
            weight_grads[i] = activations[i].T @ grad
            bias_grads[i] = grad.sum(axis=0)
            if i > 0:
                grad = grad @ weights[i].T
                grad *= activations[i] > 0  # ReLU: the activation is positive where z was
        # SGD, in place.
        for param, param_grad in zip(weights + biases, weight_grads + bias_grads, strict=True):
            param_grad *= LEARNING_RATE
            param -= param_grad
        return loss

    def extras(self) -> dict[str, Any]:
        return {"relu": "np.maximum", "loss": "hand-written softmax cross-entropy"}


class _HipsMlp(Case):
    """HIPS autograd's step: ``value_and_grad`` of the loss over the weight list, then SGD on
    the arrays. Softmax cross-entropy as the NumPy baseline computes it (the row maximum, a
    constant for the gradient, is taken from the raw values)."""

    def __init__(self, params: Params) -> None:
        import autograd.numpy as anp
        from autograd import value_and_grad
        from autograd.tracer import getval

        data = mlp_data(params["widths"], params["batch"])
        self.params = [*data.weights, *data.biases]
        self.inputs = data.inputs
        self.targets = data.targets
        rows = np.arange(params["batch"])
        layers = len(data.weights)

        def loss(params: list[Any]) -> Any:
            h = self.inputs
            for i in range(layers):
                h = anp.dot(h, params[i]) + params[layers + i]
                if i < layers - 1:
                    h = anp.maximum(h, 0.0)
            shifted = h - getval(h).max(axis=1, keepdims=True)
            log_norm = anp.log(anp.sum(anp.exp(shifted), axis=1))
            return anp.mean(log_norm - shifted[rows, self.targets])

        self.value_and_grad = value_and_grad(loss)

    def run(self) -> float:
        loss, grads = self.value_and_grad(self.params)
        for param, grad in zip(self.params, grads, strict=True):
            param -= LEARNING_RATE * grad
        return float(loss)

    def extras(self) -> dict[str, Any]:
        return {"relu": "anp.maximum", "loss": "log-softmax cross-entropy on anp"}


class _MygradMlp(Case):
    """mygrad's step: its ``softmax_crossentropy`` (mean over the batch), backward, SGD on
    the arrays, ``null_grad``."""

    def __init__(self, params: Params) -> None:
        import mygrad as mg
        from mygrad.nnet.activations import relu
        from mygrad.nnet.losses import softmax_crossentropy

        self.mg, self.relu, self.cross_entropy = mg, relu, softmax_crossentropy
        data = mlp_data(params["widths"], params["batch"])
        self.weights = [mg.tensor(w) for w in data.weights]
        self.biases = [mg.tensor(b) for b in data.biases]
        self.inputs = data.inputs
        self.targets = data.targets

    def run(self) -> float:
        mg = self.mg
        h = self.inputs
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = mg.matmul(h, w) + b
            if i < last:
                h = self.relu(h)
        loss = self.cross_entropy(h, self.targets)
        loss.backward()
        for param in (*self.weights, *self.biases):
            param.data -= LEARNING_RATE * param.grad
            param.null_grad()
        return float(loss.item())

    def extras(self) -> dict[str, Any]:
        return {"relu": "mygrad.nnet.activations.relu", "loss": "mygrad softmax_crossentropy"}


class _AioMlpPolicy(_AioMlp):
    """The subject on an engine with another policy, installed as the default engine (and
    so as the CPU budget's configuration) for its runs only."""

    policy = ag.engine.EnginePolicy()

    async def run(self) -> float:
        previous = ag.set_default_engine(self.engine)
        try:
            return await super().run()
        finally:
            ag.set_default_engine(previous if previous is not None else ag.engine.Engine())

    @property
    def engine(self) -> ag.engine.Engine:
        engine = self.__dict__.get("_engine")
        if engine is None:
            engine = self.__dict__["_engine"] = ag.engine.Engine(self.policy)
        return engine


class _AioMlpExecutors(_AioMlpPolicy):
    """No inline execution (``inline_budget_s=0``): every node on an executor thread."""

    policy = ag.engine.EnginePolicy(inline_budget_s=0.0)


class _AioMlpBlas(_AioMlpPolicy):
    """``intra_op="blas"``: a product computed alone runs on BLAS's own threads."""

    policy = ag.engine.EnginePolicy(intra_op="blas")


# spec §8's MLP 784-1024-1024-10, batch 256 (the smoke test's tiny one is 12-16-16-10).
MLP_SIZES: dict[str, Params] = {
    "full": {"widths": [784, 1024, 1024, 10], "batch": 256},
    "quick": {"widths": [784, 1024, 1024, 10], "batch": 256},
    "tiny": {"widths": [12, 16, 16, 10], "batch": 4},
}

_MLP_IMPLS = (
    Impl("aioautograd", _AioMlp),
    Impl("torch", _TorchMlp, ("torch",)),
    Impl("numpy", _NumpyMlp),
    Impl("autograd", _HipsMlp, ("autograd",)),
    Impl("mygrad", _MygradMlp, ("mygrad",)),
    Impl(f"{SUBJECT}-executors", _AioMlpExecutors, main_table=False),
    Impl(f"{SUBJECT}-blas", _AioMlpBlas, main_table=False),
)


def _mlp_summary(lines: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """Every implementation of an MLP step (variants included) with its ratio to torch."""
    torch_line = lines.get("torch")
    summary: dict[str, Any] = {}
    rows = [
        "| implementation | median | min | / torch (median) | / torch (min) |",
        "|---|---|---|---|---|",
    ]
    for name, line in lines.items():
        ratios = (
            (line["median_s"] / torch_line["median_s"], line["min_s"] / torch_line["min_s"])
            if torch_line
            else None
        )
        summary[name] = {
            "median_s": line["median_s"],
            "min_s": line["min_s"],
            "vs_torch_median": None if ratios is None else round(ratios[0], 3),
        }
        shown = ("—", "—") if ratios is None else (f"{ratios[0]:.2f}x", f"{ratios[1]:.2f}x")
        rows.append(
            f"| {name} | {format_seconds(line['median_s'])} | {format_seconds(line['min_s'])} "
            f"| {shown[0]} | {shown[1]} |"
        )
    return summary, "\n".join(rows)


def format_seconds(seconds: float) -> str:
    """A duration with three significant digits, in s, ms or µs."""
    if seconds >= 1.0:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


register(
    Workload(
        name="mlp",
        description="SGD step of an MLP 784-1024-1024-10, batch 256, float32, ReLU, cross-entropy",
        sizes=MLP_SIZES,
        repeats={"full": (5, 40), "quick": (2, 8), "tiny": (0, 1)},
        impls=_MLP_IMPLS,
        summary=_mlp_summary,
    )
)

register(
    Workload(
        name="small_mlp",
        description="SGD step of an MLP 64-64-64-10, batch 8 (overhead-bound)",
        sizes={
            "full": {"widths": [64, 64, 64, 10], "batch": 8},
            "quick": {"widths": [64, 64, 64, 10], "batch": 8},
            "tiny": {"widths": [8, 8, 8, 10], "batch": 2},
        },
        repeats={"full": (100, 1000), "quick": (20, 100), "tiny": (0, 1)},
        impls=_MLP_IMPLS,
        summary=_mlp_summary,
    )
)


def _no_cupy_gpu() -> str | None:
    from aioautograd.devices import cuda

    return None if cuda.is_available() else "CuPy sees no GPU"


def _no_torch_gpu() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "this torch build sees no GPU"


# spec §8's GPU figure: the MLP step on CuPy against torch on CUDA (skipped without a GPU).
_GPU_MLP_IMPLS = (
    Impl(SUBJECT, lambda p: _AioMlp(p, "cuda:0"), ("cupy",), unavailable=_no_cupy_gpu),
    Impl("torch", lambda p: _TorchMlp(p, "cuda"), ("torch",), unavailable=_no_torch_gpu),
)

register(
    Workload(
        name="gpu_mlp",
        description="the mlp step on cuda:0: aioautograd on CuPy vs torch CUDA",
        sizes=MLP_SIZES,
        repeats={"full": (10, 100), "quick": (3, 20), "tiny": (0, 1)},
        impls=_GPU_MLP_IMPLS,
        summary=_mlp_summary,
    )
)

# The same step where the GPU, not the host, sets the pace: 4096 wide, batch 1024.
register(
    Workload(
        name="gpu_mlp_wide",
        description="SGD step of an MLP 4096-4096-4096-10, batch 1024, float32, on cuda:0: "
        "aioautograd on CuPy vs torch CUDA",
        sizes={
            "full": {"widths": [4096, 4096, 4096, 10], "batch": 1024},
            "quick": {"widths": [4096, 4096, 4096, 10], "batch": 1024},
            "tiny": {"widths": [12, 16, 16, 10], "batch": 4},
        },
        repeats={"full": (10, 50), "quick": (3, 10), "tiny": (0, 1)},
        impls=_GPU_MLP_IMPLS,
        summary=_mlp_summary,
    )
)

# And at batch 4096, where the GPU's time per step is well above the host's.
register(
    Workload(
        name="gpu_mlp_wide_b4096",
        description="SGD step of an MLP 4096-4096-4096-10, batch 4096, float32, on cuda:0: "
        "aioautograd on CuPy vs torch CUDA",
        sizes={
            "full": {"widths": [4096, 4096, 4096, 10], "batch": 4096},
            "quick": {"widths": [4096, 4096, 4096, 10], "batch": 4096},
            "tiny": {"widths": [12, 16, 16, 10], "batch": 4},
        },
        repeats={"full": (5, 30), "quick": (2, 5), "tiny": (0, 1)},
        impls=_GPU_MLP_IMPLS,
        summary=_mlp_summary,
    )
)


# The concurrent-training, event-loop-stall and distributed figures (registered on import,
# after the ones above so that the registry keeps spec §8's order).
from benchmarks import concurrency, distributed, gpu  # noqa: E402, F401
