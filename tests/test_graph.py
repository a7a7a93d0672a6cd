"""Graph export."""

from __future__ import annotations

import aioautograd as ag


def test_to_dot_lists_every_node_and_edge() -> None:
    x = ag.randn(2, 3, requires_grad=True)
    w = ag.randn(3, 1, requires_grad=True)
    y = (x @ w).exp().sum()
    dot = ag.graph.to_dot(y)
    assert dot.startswith("digraph backward {")
    assert dot.rstrip().endswith("}")
    for name in ("SumBackward0", "ExpBackward0", "MatMulBackward0", "AccumulateGrad"):
        assert name in dot
    nodes = list(ag.graph.walk(y))
    assert len(nodes) == 5
    assert dot.count(" -> ") == 1 + 4  # root edge + four graph edges
    assert "(2, 3) float32" in dot


def test_walk_handles_a_deep_chain() -> None:
    x = ag.randn(2, requires_grad=True)
    h = x
    for _ in range(5000):
        h = h * 1.0
    assert sum(1 for _ in ag.graph.walk(h)) == 5001
