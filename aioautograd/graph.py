"""Public helpers over the backward graph: ``to_dot`` (Graphviz source) and ``walk``."""

from __future__ import annotations

from collections.abc import Iterator

from aioautograd.autograd.node import AccumulateGrad, Node
from aioautograd.tensor import Tensor


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


def to_dot(root: Tensor | Node, name: str = "backward") -> str:
    """Graphviz source of the backward graph of ``root``.

    Render it with the ``graphviz`` package (``graphviz.Source(to_dot(loss))``) or the
    ``dot`` command. Edges point from a node to the nodes its gradients flow into, and are
    labelled ``output -> input`` where a node has several.
    """
    lines = [f"digraph {name} {{", '  node [shape=box, fontname="Helvetica", fontsize=10];']
    if isinstance(root, Tensor):
        lines.append(
            f'  root [label="{tuple(root.shape)} {root.dtype}", shape=oval, style=filled, '
            'fillcolor="#d9ead3"];'
        )
        if root.grad_fn is not None:
            lines.append(f"  root -> n{id(root.grad_fn)};")
    for node in walk(root):
        style = ', style=filled, fillcolor="#cfe2f3"' if isinstance(node, AccumulateGrad) else ""
        lines.append(f'  n{id(node)} [label="{_label(node)}"{style}];')
        edges = node.next_functions
        for output_nr, (next_node, input_nr) in enumerate(edges):
            if next_node is None:
                continue
            label = f' [label="{output_nr}->{input_nr}"]' if len(edges) > 1 else ""
            lines.append(f"  n{id(node)} -> n{id(next_node)}{label};")
    lines.append("}")
    return "\n".join(lines)
