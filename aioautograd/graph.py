"""Public helpers over the backward graph (PyTorch's ``torch.autograd.graph``):
``saved_tensors_hooks``, ``GradientEdge`` / ``get_gradient_edge``, ``increment_version``,
``walk``, ``to_dot`` (Graphviz source) and ``draw`` (a matplotlib figure, for when Graphviz
is not installed)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextvars import Token
from typing import Any

from aioautograd.autograd.node import AccumulateGrad, GradientEdge, Node
from aioautograd.autograd.saved import PackHook, UnpackHook, saved_tensors_hooks_stack
from aioautograd.tensor import Tensor

__all__ = [
    "GradientEdge",
    "get_gradient_edge",
    "increment_version",
    "saved_tensors_hooks",
    "to_dot",
    "walk",
]


class saved_tensors_hooks:
    """Within this block, tensors that nodes save for backward go through
    ``pack_hook(tensor) -> packed`` when saved and ``unpack_hook(packed) -> tensor`` when the
    backward reads them (PyTorch's ``torch.autograd.graph.saved_tensors_hooks``).

    The hooks live in a ``ContextVar``: they apply to the current asyncio task (or the
    thread outside any task) only, so two tasks never see each other's hooks. Nested blocks:
    the innermost pair applies. ``unpack_hook`` runs during backward, usually on an executor
    thread, and must return a tensor with the saved tensor's content. Example::

        def pack(t):
            return t.detach().cpu()          # e.g. offload to the host

        def unpack(t):
            return t.to(device)

        with saved_tensors_hooks(pack, unpack):
            loss = model(x).sum()
        await loss.backward()

    Tensors that built-in ops keep other than through ``save_for_backward`` (Python
    numbers, masks) are not passed to the hooks.
    """

    def __init__(self, pack_hook: PackHook, unpack_hook: UnpackHook) -> None:
        self.pack_hook = pack_hook
        self.unpack_hook = unpack_hook
        self._tokens: list[Token[tuple[tuple[PackHook, UnpackHook], ...]]] = []

    def __enter__(self) -> saved_tensors_hooks:
        stack = saved_tensors_hooks_stack.get()
        pair = (self.pack_hook, self.unpack_hook)
        self._tokens.append(saved_tensors_hooks_stack.set((*stack, pair)))
        return self

    def __exit__(self, *exc: object) -> None:
        saved_tensors_hooks_stack.reset(self._tokens.pop())


def get_gradient_edge(tensor: Tensor) -> GradientEdge:
    """The edge through which gradient flows into ``tensor``: ``(tensor.grad_fn,
    tensor.output_nr)``, or the leaf's ``AccumulateGrad`` node.

    Pass it to ``grad(..., inputs=edge)`` to differentiate with respect to the tensor as it
    was here, even if it is later modified in place.

    Raises:
        RuntimeError: if ``tensor`` does not require grad.
    """
    if not tensor.requires_grad:
        raise RuntimeError(
            "It is not possible to get the gradient edge for a Tensor that does not require "
            "gradients; call requires_grad_() on the leaf first"
        )
    node, output_nr = tensor._gradient_edge()
    return GradientEdge(node, output_nr)


def increment_version(tensor: Tensor | Iterable[Tensor]) -> None:
    """Bump the version counter of ``tensor`` (or of each tensor of an iterable), as an
    in-place op does: for code that changes ``tensor.data`` behind autograd's back, so that
    a backward that saved the tensor fails loudly instead of using the new values."""
    tensors: Iterable[Any] = (tensor,) if isinstance(tensor, Tensor) else tensor
    for item in tensors:
        if not isinstance(item, Tensor):
            raise TypeError(f"increment_version expects Tensors, got {type(item).__name__}")
        item._bump_version()


def walk(root: Tensor | Node) -> Iterator[Node]:
    """Every node reachable from ``root`` (a tensor's ``grad_fn`` or a node), each once,
    depth-first without recursion."""
    start = root.grad_fn if isinstance(root, Tensor) else root
    if start is None:
        return
    seen = {start}
    stack = [start]
    while stack:
        node = stack.pop()
        yield node
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                stack.append(next_node)


def _label(node: Node) -> str:
    if isinstance(node, AccumulateGrad):
        variable = node.variable
        return f"AccumulateGrad\\n{tuple(variable.shape)} {variable.dtype}"
    return node.name()


def _node_ids(root: Tensor | Node) -> dict[Node, str]:
    """Readable, stable identifiers: the op's name, numbered when it occurs more than once
    (``MulBackward0``, ``MulBackward0_2``), in walk order."""
    ids: dict[Node, str] = {}
    counts: dict[str, int] = {}
    for node in walk(root):
        base = "AccumulateGrad" if isinstance(node, AccumulateGrad) else node.name()
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in base)
        counts[base] = counts.get(base, 0) + 1
        ids[node] = base if counts[base] == 1 else f"{base}_{counts[base]}"
    return ids


def to_dot(root: Tensor | Node, name: str = "backward") -> str:
    """Graphviz source of the backward graph of ``root``.

    Render it with the ``graphviz`` package (``graphviz.Source(to_dot(loss))``) or the
    ``dot`` command. Edges point from a node to the nodes its gradients flow into, and are
    labelled ``output -> input`` where a node has several.
    """
    ids = _node_ids(root)
    lines = [f"digraph {name} {{", '  node [shape=box, fontname="Helvetica", fontsize=10];']
    if isinstance(root, Tensor):
        lines.append(
            f'  root [label="{tuple(root.shape)} {root.dtype}", shape=oval, style=filled, '
            'fillcolor="#d9ead3"];'
        )
        if root.grad_fn is not None:
            lines.append(f"  root -> {ids[root.grad_fn]};")
    for node in walk(root):
        style = ', style=filled, fillcolor="#cfe2f3"' if isinstance(node, AccumulateGrad) else ""
        lines.append(f'  {ids[node]} [label="{_label(node)}"{style}];')
        edges = node.next_functions
        for output_nr, (next_node, input_nr) in enumerate(edges):
            if next_node is None:
                continue
            label = f' [label="{output_nr}->{input_nr}"]' if len(edges) > 1 else ""
            lines.append(f"  {ids[node]} -> {ids[next_node]}{label};")
    lines.append("}")
    return "\n".join(lines)


def draw(root: Tensor | Node, ax: Any = None) -> Any:
    """Draw the backward graph of ``root`` with matplotlib (``pip install
    'aioautograd[viz]'``); returns the Axes.

    Nodes are boxes labelled with their op, laid out in rows by distance from the root
    (the root on top, ``AccumulateGrad`` leaves shaded blue); arrows point where gradients
    flow. Meant for graphs of up to a few dozen nodes; use :func:`to_dot` with Graphviz for
    larger ones.
    """
    import matplotlib.pyplot as plt

    nodes = list(walk(root))
    depth: dict[Node, int] = {}
    for node in nodes:  # longest distance from the root, so every arrow points down
        depth.setdefault(node, 0)
    changed = True
    while changed:
        changed = False
        for node in nodes:
            for next_node, _ in node.next_functions:
                if next_node is not None and depth[next_node] < depth[node] + 1:
                    depth[next_node] = depth[node] + 1
                    changed = True
    rows: dict[int, list[Node]] = {}
    for node in nodes:
        rows.setdefault(depth[node], []).append(node)
    position: dict[Node, tuple[float, float]] = {}
    widest = max((len(row) for row in rows.values()), default=1)
    for level, row in rows.items():
        for i, node in enumerate(row):
            position[node] = ((i + 0.5) * widest / len(row), -float(level))
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 2.2 * widest), 0.9 * (len(rows) + 1)))
    for node in nodes:
        x, y = position[node]
        for next_node, _ in node.next_functions:
            if next_node is not None:
                nx, ny = position[next_node]
                ax.annotate(  # from the bottom of this box to the top of the next one
                    "",
                    xy=(nx, ny + 0.22),
                    xytext=(x, y - 0.22),
                    arrowprops={"arrowstyle": "-|>", "color": "0.4", "shrinkA": 0, "shrinkB": 0},
                )
        leaf = isinstance(node, AccumulateGrad)
        ax.text(
            x,
            y,
            _label(node).replace("\\n", "\n"),
            ha="center",
            va="center",
            fontsize=8,
            bbox={"boxstyle": "round", "fc": "#cfe2f3" if leaf else "white", "ec": "0.3"},
        )
    ax.set_xlim(0, widest)
    ax.set_ylim(-len(rows) + 0.4, 0.6)
    ax.axis("off")
    return ax
