"""Graph export."""

from __future__ import annotations

import pytest

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


def test_to_dot_names_nodes_by_op() -> None:
    x = ag.randn(3, requires_grad=True)
    y = (x * 2.0 * 3.0).sum()
    dot = ag.graph.to_dot(y)
    assert "root -> SumBackward0;" in dot
    assert "SumBackward0 -> MulBackward0" in dot
    assert "MulBackward0 -> MulBackward0_2" in dot
    assert "MulBackward0_2 -> AccumulateGrad" in dot
    assert " n1" not in dot  # no id()-based names


def test_draw_places_every_node_once_with_matplotlib() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    x = ag.randn(2, 3, requires_grad=True)
    w = ag.randn(3, 1, requires_grad=True)
    y = (x @ w).exp().sum()
    ax = ag.graph.draw(y)
    labels = sorted(text.get_text() for text in ax.texts if text.get_text())
    assert labels == sorted(
        [
            "SumBackward0",
            "ExpBackward0",
            "MatMulBackward0",
            "AccumulateGrad\n(2, 3) float32",
            "AccumulateGrad\n(3, 1) float32",
        ]
    )
    arrows = [text for text in ax.texts if not text.get_text()]
    assert len(arrows) == 4  # one per graph edge
    # The root is on top, every arrow points down.
    positions = {text.get_text(): text.get_position() for text in ax.texts if text.get_text()}
    assert positions["SumBackward0"][1] > positions["ExpBackward0"][1]
    assert positions["MatMulBackward0"][1] > positions["AccumulateGrad\n(3, 1) float32"][1]
    import matplotlib.pyplot as plt

    plt.close(ax.figure)


def test_a_recorded_nodes_topological_and_sequence_numbers() -> None:
    # Function.apply sets Node.__init__'s fields itself: the longest path to a leaf, the
    # creation order, and a lock and a metadata list of the node's own.
    a = ag.randn(3, 4, requires_grad=True)
    w = ag.randn(4, 2, requires_grad=True)
    h = a @ w  # two leaves' accumulators: 1
    c = h * 2.0  # 2
    d = h + c  # the longer of its two paths: 3
    e = ag.randn(3, 2) * d  # a data operand adds no path: 4
    f = ag.randn(3, 2, requires_grad=True) + 1.0  # a leaf and a number: 1
    g = f + ag.randn(3, 2)  # 2
    nodes = [t.grad_fn for t in (h, c, d, e, f, g)]
    assert [n.topological_nr for n in nodes] == [1, 2, 3, 4, 1, 2]  # type: ignore[union-attr]
    sequence = [n.sequence_nr for n in nodes]  # type: ignore[union-attr]
    assert sequence == sorted(sequence)
    assert len(set(sequence)) == len(sequence)
    assert len({id(n._lock) for n in nodes}) == len(nodes)  # type: ignore[union-attr]
    assert [n.num_inputs for n in nodes] == [1] * len(nodes)  # type: ignore[union-attr]
    assert h.grad_fn.next_functions[0][0].topological_nr == 0  # type: ignore[union-attr]
