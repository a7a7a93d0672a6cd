"""The wire format on its own: round trips, refusals, and hostile bytes (no worker needed)."""

from __future__ import annotations

import collections
import dataclasses
import enum
import random
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import aioautograd as ag
from aioautograd.distributed import rpc
from aioautograd.distributed.rpc import wire

FIELDS = {"k": wire.REQUEST, "id": 3, "src": "a", "fn": "m:f"}


def round_trip(payload: Any, **hooks: Any) -> Any:
    message, _ = wire.encode(FIELDS, payload, hooks.get("send"))
    received = wire.Message.from_bytes(message.to_bytes())
    header = wire.decode_header(received)
    assert (header.kind, header.call_id, header.src, header.function) == (0, 3, "a", "m:f")
    return wire.decode_payload(header, received, hooks.get("receive"))


class Color(enum.IntEnum):
    RED = 1


def test_round_trip_keeps_types() -> None:
    t = ag.tensor([[1.0, 2.0]], dtype="float16", requires_grad=True)
    payload = (t, [t, np.int8(3), 2.5j], collections.OrderedDict(a=Color.RED), bytearray(b"x"))
    back = round_trip(payload)
    assert isinstance(back, tuple)
    assert len(back) == 4
    tensor, (alias, scalar, number), mapping, raw = back
    assert alias is tensor
    assert tensor.dtype == np.float16
    assert tensor.requires_grad
    assert tensor.tolist() == [[1.0, 2.0]]
    assert tensor.shape == (1, 2)
    assert type(scalar) is np.int8
    assert number == 2.5j
    assert mapping == {"a": 1}
    assert type(mapping["a"]) is int
    assert raw == b"x"


def test_snapshot_does_not_alias_the_sender() -> None:
    data = np.zeros(4)
    message, _ = wire.encode(FIELDS, [ag.tensor(data)])
    snapshot = message.snapshot()
    data[:] = 7  # the sender mutates its array after sending
    (tensor,) = wire.decode_payload(wire.decode_header(snapshot), snapshot)
    assert tensor.tolist() == [0.0] * 4
    tensor.data[0] = 1  # received arrays are writable and owned by the receiver


def test_received_arrays_are_writable_copies() -> None:
    back = round_trip([np.arange(3)])
    back[0][0] = 5
    assert back[0].flags.writeable


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (object(), "no pickle"),
        ({1, 2}, "no pickle"),
        (np.array(["text"]), "dtype <U4"),
        (np.array([None]), "dtype object"),
        (np.zeros(2, dtype=[("a", "i4")]), "dtype"),
        (2**70, "64-bit"),
    ],
)
def test_values_that_cannot_travel(value: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        wire.encode(FIELDS, [value])


def test_interceptor_hooks_see_tensors_and_metadata() -> None:
    a, b = ag.tensor([1.0]), ag.tensor([2], dtype="int64")
    seen: list[Any] = []

    def send(tensors: list[ag.Tensor]) -> dict[str, Any]:
        seen.append([t.tolist() for t in tensors])
        return {"mine": {"n": len(tensors)}}

    message, _ = wire.encode(FIELDS, {"x": [a, b, np.ones(1)]}, send)
    header = wire.decode_header(message)
    assert header.metadata == {"mine": {"n": 2}}
    assert seen == [[[1.0], [2]]]

    def receive(tensors: list[ag.Tensor]) -> list[ag.Tensor]:
        return [ag.tensor([9.0]) for _ in tensors]

    back = wire.decode_payload(header, message, receive)
    assert [t.tolist() for t in back["x"][:2]] == [[9.0], [9.0]]
    assert isinstance(back["x"][2], np.ndarray)


def _frame() -> bytes:
    message, _ = wire.encode(
        FIELDS,
        [[ag.tensor(np.arange(6.0).reshape(2, 3), requires_grad=True), (1, "two")], {"k": b"v"}],
    )
    return message.to_bytes()


def _decode(data: bytes) -> Any:
    message = wire.Message.from_bytes(data)
    return wire.decode_payload(wire.decode_header(message), message)


def test_every_truncation_is_rejected() -> None:
    frame = _frame()
    for cut in range(len(frame)):
        with pytest.raises(rpc.MalformedMessageError):
            _decode(frame[:cut])


def test_random_corruption_raises_only_malformed_message_errors() -> None:
    frame = bytearray(_frame())
    rng = random.Random(0)
    outcomes = collections.Counter()
    for _ in range(3000):
        corrupt = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            corrupt[rng.randrange(len(corrupt))] = rng.randrange(256)
        try:
            _decode(bytes(corrupt))
            outcomes["decoded"] += 1
        except rpc.MalformedMessageError:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 0
    for _ in range(500):
        garbage = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
        with pytest.raises(rpc.MalformedMessageError):
            _decode(wire.MAGIC + garbage)


def _with_header(header: dict[str, Any], buffers: list[bytes] = ()) -> bytes:
    return wire.Message(msgpack.packb(header), buffers).to_bytes()


BASE = {"k": 0, "id": 1, "src": "a", "fn": "m:f"}


@pytest.mark.parametrize(
    ("header", "buffers", "match"),
    [
        ({**BASE, "k": 9}, [], "unknown kind"),
        ({**BASE, "id": True}, [], "'id'"),
        ({**BASE, "fn": 5}, [], "'fn'"),
        ({**BASE, "t": [[0, "|O", [1], "cpu", False]]}, [b"\0" * 8], "not accepted"),
        ({**BASE, "t": [[0, "<f8", [2], "cpu", False]]}, [b"\0" * 8], "needs 16 bytes"),
        ({**BASE, "t": [[0, "<i8", [1], "cpu", True]]}, [b"\0" * 8], "requires_grad"),
        ({**BASE, "t": [[0, "<f8", [-1], "cpu", False]]}, [b""], "shape"),
        ({**BASE, "t": [[0, "<f8", [1], "tpu:0", False]]}, [b"\0" * 8], "device"),
        ({**BASE, "t": [[0, "<f8", [True], "cpu", False]]}, [b"\0" * 8], "shape"),
        ({**BASE, "t": [[2, "<f8", [1], "cpu", False]]}, [b"\0" * 8], "scalar with a shape"),
        ({**BASE, "t": [[7, "<f8", [1], "cpu", False]]}, [b"\0" * 8], "unknown array kind"),
        ({**BASE, "t": [[0, "<f8", [1], "cpu", 1]]}, [b"\0" * 8], "requires_grad"),
        ({**BASE, "t": [[0, "<f8", [1], 0, False]]}, [b"\0" * 8], "device"),
        ({**BASE, "t": [[0, "<f8", [1], "cpu"]]}, [b"\0" * 8], "wrong length"),
        ({**BASE, "t": [[0, "<f8", [1], "cpu", False]]}, [], "1 arrays described, 0 sent"),
        ({**BASE, "p": msgpack.packb(msgpack.ExtType(1, b"\0\0\0\5"))}, [], "out of range"),
        ({**BASE, "p": msgpack.packb(msgpack.ExtType(99, b""))}, [], "unknown extension"),
        ({**BASE, "p": b"\xc1"}, [], "payload"),
    ],
)
def test_hostile_headers(header: dict[str, Any], buffers: list[bytes], match: str) -> None:
    with pytest.raises(rpc.MalformedMessageError, match=match):
        _decode(_with_header(header, buffers))


def test_deeply_nested_tuples_are_rejected_cleanly() -> None:
    payload = msgpack.packb([])
    for _ in range(5000):
        payload = msgpack.packb(msgpack.ExtType(wire.EXT_TUPLE, payload))
    with pytest.raises(rpc.MalformedMessageError):
        _decode(_with_header({**BASE, "p": payload}))


def test_no_pickle_in_the_rpc_package() -> None:
    package = Path(rpc.__file__).parent
    for path in package.rglob("*.py"):
        source = path.read_text()
        assert "import pickle" not in source, path
        assert "cloudpickle" not in source, path


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6, dtype=">f4").reshape(2, 3),  # big-endian: converted
        np.arange(12.0).reshape(3, 4)[:, ::2],  # not contiguous: a contiguous copy
        np.arange(6.0).reshape(2, 3).T,
        np.array([True, False]),
        np.arange(-3, 3, dtype=np.int8),
        np.array(2.5, dtype=np.float32),  # 0-d
        np.zeros((0, 3), dtype=np.complex64),
    ],
)
def test_arrays_of_every_layout_arrive_equal_and_native(array: np.ndarray) -> None:
    tensor, plain = round_trip([ag.Tensor(array), array])
    for back in (tensor.data, plain):
        assert back.shape == array.shape
        assert back.dtype == array.dtype.newbyteorder("=")
        assert back.dtype.isnative
        assert back.flags.c_contiguous
        assert np.array_equal(back, array)


def test_a_payload_bounded_by_its_size_needs_no_count() -> None:
    # An entry takes a byte at least: a payload of at most MAX_ITEMS bytes decodes without
    # counting its entries; one entry (and byte) more is counted and refused.
    header_bytes = len(msgpack.packb([None] * wire.MAX_ITEMS)) - wire.MAX_ITEMS
    fits = [None] * (wire.MAX_ITEMS - header_bytes)
    payload = msgpack.packb(fits)
    assert len(payload) == wire.MAX_ITEMS
    assert _decode(_with_header({**BASE, "p": payload})) == fits
    over = msgpack.packb([None] * (wire.MAX_ITEMS + 1))
    with pytest.raises(rpc.MalformedMessageError, match="list, tuple and dict entries"):
        _decode(_with_header({**BASE, "p": over}))


def test_a_refused_device_stays_refused() -> None:
    for _ in range(2):  # parsed devices are cached: refusals must not be
        with pytest.raises(rpc.MalformedMessageError, match="bad device 'tpu:0'"):
            _decode(_with_header({**BASE, "t": [[0, "<f8", [1], "tpu:0", False]]}, [b"\0" * 8]))


def test_tensors_keep_their_device() -> None:
    try:
        device = ag.device("sim:1")  # a NumPy-backed simulated accelerator, when available
    except ValueError:
        pytest.skip("no simulated device backend in this tree")
    (tensor,) = round_trip([ag.Tensor(np.ones(2), device, True)])
    assert tensor.device is device
    assert tensor.requires_grad


def test_an_unavailable_device_is_a_clear_error() -> None:
    message, _ = wire.encode(FIELDS, [ag.tensor([1.0])])
    header = wire.decode_header(message)
    header.table[0][3] = "cuda:999"
    with pytest.raises(rpc.RpcError, match="cannot receive an array on cuda:999"):
        wire.decode_payload(header, message)


def test_what_a_message_may_declare_is_bounded() -> None:
    # Many empty buffers: refused from the framing prefix, before any view is made.
    many = wire.Message(msgpack.packb(BASE), [b""] * (wire.MAX_BUFFERS + 1)).to_bytes()
    with pytest.raises(rpc.MalformedMessageError, match=f"at most {wire.MAX_BUFFERS}"):
        _decode(many)
    with pytest.raises(TypeError, match="stack them into fewer tensors"):
        wire.encode(FIELDS, [np.zeros(0) for _ in range(wire.MAX_BUFFERS + 1)])
    # Many entries (a huge kwargs dict, or many lists that are each small enough).
    kwargs = {f"k{i}": None for i in range(wire.MAX_ITEMS + 1)}
    for payload in ([[], kwargs], [[[0] * 1000] * (wire.MAX_ITEMS // 1000 + 1), {}]):
        with pytest.raises(rpc.MalformedMessageError, match="list, tuple and dict entries"):
            _decode(_with_header({**BASE, "p": msgpack.packb(payload)}))
    tuples = msgpack.packb([msgpack.ExtType(wire.EXT_TUPLE, msgpack.packb([1] * 1000))] * 300)
    with pytest.raises(rpc.MalformedMessageError, match="list, tuple and dict entries"):
        _decode(_with_header({**BASE, "p": tuples}))
    # Just under the bounds still travels.
    assert round_trip([[0] * (wire.MAX_ITEMS - 10), {}]) == [[0] * (wire.MAX_ITEMS - 10), {}]


def test_message_info_is_a_frozen_value() -> None:
    # Interceptors may keep, compare and hash what they are given.
    src, dst = rpc.WorkerInfo("a", 0), rpc.WorkerInfo("b", 1)
    info = rpc.MessageInfo("request", src, dst, 3, "m:f")
    assert info == rpc.MessageInfo("request", src, dst, 3, "m:f")
    assert info != dataclasses.replace(info, call_id=4)
    assert hash(info) == hash(rpc.MessageInfo("request", src, dst, 3, "m:f"))
    assert (info.kind, info.src, info.dst, info.call_id, info.function) == (
        "request",
        src,
        dst,
        3,
        "m:f",
    )
    assert "call_id=3" in repr(info)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.call_id = 5  # type: ignore[misc]
