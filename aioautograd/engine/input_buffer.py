"""Input buffers: the gradients a node has received so far, one slot per input.

``accumulate`` is PyTorch's ``InputBuffer::add``: gradients arriving at the same input are
summed, and on accelerators the consumer's stream is made to wait (on the device, with an
event) for the producer's stream before it touches a gradient the producer computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aioautograd.devices.device import CPU, Device
from aioautograd.grad_mode import _grad_enabled
from aioautograd.tensor import wrap

if TYPE_CHECKING:
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


def _sum(old: Tensor, grad: Tensor) -> Tensor:
    """``old + grad``; recorded only under ``create_graph``, else one array addition (both
    gradients were validated against the same input: same shape, dtype and device)."""
    if _grad_enabled.get():
        return old + grad
    return wrap(old.xp.add(old.data, grad.data), old.device)


def buffer_device(buffer: InputBuffer) -> Device:
    """The device a task runs on: that of its first defined input gradient (else CPU)."""
    if buffer and buffer[0] is not None:  # the common case, without a loop
        return buffer[0].device
    for grad in buffer:
        if grad is not None:
            return grad.device
    return CPU
