"""Input buffers: the gradients a node has received so far, one slot per input.

``accumulate`` is PyTorch's ``InputBuffer::add``: gradients arriving at the same input are
summed, and on accelerators the consumer's stream is made to wait (on the device, with an
event) for the producer's stream before it touches a gradient the producer computed.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any

from aioautograd.autograd.node import AccumulateGrad
from aioautograd.devices.device import CPU, Device
from aioautograd.grad_mode import _grad_enabled_get
from aioautograd.tensor import wrap

if TYPE_CHECKING:
    from aioautograd.autograd.node import Node
    from aioautograd.devices.streams import Stream
    from aioautograd.tensor import Tensor

InputBuffer = list["Tensor | None"]


def accumulate(
    buffer: InputBuffer,
    position: int,
    grad: Tensor | None,
    producer: Stream | None,
    consumer: Stream | None,
) -> None:
    """Add ``grad`` into ``buffer[position]``, ordering ``consumer`` after ``producer``."""
    if grad is None:
        return
    old = buffer[position]
    if producer is None and consumer is None:  # CPU
        buffer[position] = grad if old is None else _sum(old, grad)
        return
    if consumer is not None and grad.device is consumer.device:
        if producer is not None and producer.device is grad.device:
            if consumer != producer:
                consumer.wait_event(producer.record_event())
        else:
            # The gradient was copied here by a node of another device (a CPU node's
            # ``.to(cuda)``): the copy went to this thread's current stream of the device.
            current = grad.device.current_stream()
            if current is not None:
                consumer.wait_stream(current)
    if old is None:
        buffer[position] = grad
        return
    stream = consumer if consumer is not None and grad.device is consumer.device else producer
    with grad.device.backend.use_stream(stream, "accumulate"):
        buffer[position] = _sum(old, grad)


class SlotOrder:
    """The fixed order in which the gradients flowing into one input of a node are summed.

    Floating-point addition is not associative: with three or more gradients into one
    input, summing them as they arrive from different workers (or ``async`` nodes) would
    make the result depend on scheduling. They are summed in the order of their edges
    instead, producers latest-created first (the order one thread running the ready queue
    produces, so usually nothing waits); a gradient that arrives early is held until the
    ones before it are in. Two gradients need no order (``a + b == b + a``).
    """

    __slots__ = ("expected", "held", "next", "outputs", "owned")

    def __init__(self, expected: list[Node], outputs: list[int] | None) -> None:
        # The producers in summation order, and the output index of each one's edge
        # (``None`` when every producer has one edge into this input: a fan's branches).
        self.expected = expected
        self.outputs = outputs
        self.next = 0
        # Gradients that arrived early, by producer (and output index, with ``outputs``).
        self.held: dict[Any, tuple[Tensor | None, Stream | None]] | None = None
        # The slot holds a sum this order made (a fresh array nobody else sees): on CPU
        # without create_graph the next terms are added into it in place.
        self.owned = False

    def add(
        self,
        buffer: InputBuffer,
        position: int,
        source: Node,
        output_nr: int,
        grad: Tensor | None,
        producer: Stream | None,
        consumer: Stream | None,
    ) -> None:
        """``accumulate`` the gradient ``source`` sent along its edge ``output_nr``, once
        every gradient before it in the order is in."""
        expected = self.expected
        outputs = self.outputs
        k = self.next
        if k == len(expected):  # an edge the graph walk did not see: nothing to order by
            accumulate(buffer, position, grad, producer, consumer)
            return
        if expected[k] is not source or (outputs is not None and outputs[k] != output_nr):
            if self.held is None:
                self.held = {}
            self.held[source if outputs is None else (source, output_nr)] = (grad, producer)
            return
        if producer is None and consumer is None and grad is not None:  # CPU
            # (inline, not a method: this runs for every gradient of a fan-in)
            old = buffer[position]
            if old is None:
                buffer[position] = grad
            elif _grad_enabled_get():  # create_graph: the sum is recorded
                buffer[position] = old + grad
                self.owned = False
            elif self.owned:
                data = old.data
                # The same ufunc as _sum, so the same bits; ``out`` positional (a keyword
                # costs NumPy an argument parse).
                old.device.xp.add(data, grad.data, data)
            else:
                buffer[position] = _sum(old, grad)
                self.owned = True
        else:
            accumulate(buffer, position, grad, producer, consumer)
        k += 1
        held = self.held
        while held and k < len(expected):
            key = expected[k] if outputs is None else (expected[k], outputs[k])
            term = held.pop(key, None)
            if term is None:
                break
            accumulate(buffer, position, term[0], term[1], consumer)
            k += 1
        self.next = k


_sequence_nr = attrgetter("sequence_nr")


def slot_orders(node: Node, producers: list[Node]) -> list[SlotOrder | None] | None:
    """The :class:`SlotOrder` of each input of ``node`` that three or more edges feed
    (``None`` for the others), or ``None`` when no input needs one.

    ``producers`` are the nodes with edges into ``node``, one entry per edge (the graph walk
    lists a producer's edges one after another).
    """
    if len(producers) < 3:
        return None
    inputs = 1 if type(node) is AccumulateGrad else len(node._input_metadata)
    count = len(producers)
    if (
        inputs == 1
        and len(set(producers)) == count
        and len(set(map(_sequence_nr, producers))) == count
    ):
        # One input, one edge from each producer (a fan's branches): the order is the
        # producers', latest-created first, found without a loop over their edges (the
        # general case's order when no two share a sequence number).
        return [SlotOrder(sorted(producers, key=_sequence_nr, reverse=True), None)]
    edges: list[list[tuple[int, int, Node]]] = [[] for _ in range(inputs)]
    previous = None
    for producer in producers:
        if producer is previous:
            continue
        previous = producer
        key = -producer.sequence_nr
        output_nr = -1
        for target, input_nr in producer._next_edges:
            output_nr += 1
            if target is node:
                edges[input_nr].append((key, output_nr, producer))
    orders: list[SlotOrder | None] = []
    needed = False
    for slot in edges:
        if len(slot) < 3:
            orders.append(None)
            continue
        try:
            slot.sort()
        except TypeError:  # two producers with one sequence number: keep the walk's order
            slot.sort(key=lambda edge: (edge[0], edge[1]))
        orders.append(SlotOrder([edge[2] for edge in slot], [edge[1] for edge in slot]))
        needed = True
    return orders if needed else None


def _sum(old: Tensor, grad: Tensor) -> Tensor:
    """``old + grad``; recorded only under ``create_graph``, else one array addition (both
    gradients were validated against the same input: same shape, dtype and device)."""
    if _grad_enabled_get():
        return old + grad
    device = old.device
    return wrap(device.xp.add(old.data, grad.data), device)


def buffer_device(buffer: InputBuffer) -> Device:
    """The device a task runs on: that of its first defined input gradient (else CPU)."""
    if buffer and buffer[0] is not None:  # the common case, without a loop
        return buffer[0].device
    for grad in buffer:
        if grad is not None:
            return grad.device
    return CPU
