"""The wire format: msgpack for structure, raw contiguous buffers for arrays. No pickle.

A message is a msgpack *header* plus one raw buffer per array it carries. On a byte stream
(gRPC) it is framed as::

    b"AAG\\x01"                      magic and format version
    header length, buffer count      two little-endian uint32
    buffer lengths                   one little-endian uint64 each
    header                           msgpack map (below)
    buffers                          the raw bytes of each array, in table order

The header holds the routing fields (kind, call id, sender, function name, RRef id,
timeout), the metadata that interceptors attach (``"m"``), the *array table* (``"t"``: one
``[kind, dtype, shape, device, requires_grad]`` entry per tensor, NumPy array or NumPy
scalar) and the payload (``"p"``): a msgpack document in which arrays are extension objects
that point into the table. Tuples, complex numbers, devices, worker infos and RRefs are
extension objects too, so they come back as what they were.

Tensors keep their dtype, shape, device and ``requires_grad``; their values arrive bit for bit
(NaN payloads included). Non-contiguous arrays are sent as C-contiguous copies. CuPy arrays
travel through host memory for now: the sender copies them to the host, the receiver back to
the same ``cuda:N`` device (which it must have). Only numeric dtypes (bool, signed and
unsigned integers, float16/32/64, complex64/128) are accepted; object arrays and any other
Python object are refused with ``TypeError`` on the sender.

Decoding never executes anything it reads: malformed, truncated or hostile bytes raise
:class:`~aioautograd.distributed.rpc.errors.MalformedMessageError`. What a message may declare
is bounded, so that a small message cannot cost much memory: at most :data:`MAX_BUFFERS`
arrays and :data:`MAX_ITEMS` list, tuple and dict entries (all containers together).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack  # type: ignore[import-untyped]
import numpy as np

from aioautograd.devices.device import CPU, Device
from aioautograd.devices.device import device as parse_device
from aioautograd.distributed.rpc.errors import MalformedMessageError, RpcError
from aioautograd.tensor import Tensor

MAGIC = b"AAG\x01"
_PREFIX = struct.Struct("<4sII")
_LENGTH = struct.Struct("<Q")
_SIZE = struct.Struct("<I")  # to_bytes(sized=True)
# What one message may declare, so that a small hostile message cannot cost a lot of memory
# (a Python object per msgpack item or buffer is ~30-200x the bytes that declare it).
MAX_BUFFERS = 1 << 16  # arrays in one message
MAX_ITEMS = 1 << 18  # list, tuple and map entries in one payload, all containers together
_MAX_HEADER_MAP = 1 << 10
_TOO_MANY_ITEMS = (
    f"malformed message: more than {MAX_ITEMS} list, tuple and dict entries (send large "
    "collections of numbers as tensors or arrays)"
)
_MAX_NDIM = 64
_MAX_DEPTH = 100  # nested tuples, RRefs, ... in one payload

# Message kinds.
REQUEST = 0
RESPONSE = 1
ERROR = 2

# Array-table entry kinds.
KIND_TENSOR = 0
KIND_NDARRAY = 1
KIND_SCALAR = 2

# msgpack extension codes.
EXT_ARRAY = 1
EXT_TUPLE = 2
EXT_COMPLEX = 3
EXT_DEVICE = 4
EXT_WORKER_INFO = 5
EXT_RREF = 6

_PLAIN_TYPES: tuple[type, ...] = (bool, int, float, str, bytes, dict, list)
_COMPLEX = struct.Struct("<dd")
_INDEX = struct.Struct("<I")

_ALLOWED_DTYPES = frozenset(
    np.dtype(name).newbyteorder("<").str
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
)

_DTYPES = {name: np.dtype(name) for name in _ALLOWED_DTYPES}
_DEVICES = {"cpu": CPU}  # device names received, parsed (devices are interned)
# The accepted dtypes that need no conversion to travel (little-endian or byte-sized), by
# dtype: the common case of encoding an array is one dictionary lookup.
_WIRE_NAMES = {dtype: name for name, dtype in _DTYPES.items() if dtype.isnative}

# Anything with the buffer protocol: bytes, bytearray, memoryview, a uint8 ndarray.
Buffer: TypeAlias = Any
# Metadata that interceptors attach to a message, by interceptor name.
Metadata = dict[str, Any]
# Encoding an object with ``__rpc_encode__`` yields (extension code, msgpack-able fields).
ExtDecoder = Callable[[list[Any]], Any]


class Message:
    """An encoded message: the msgpack header and the raw array buffers it points to."""

    __slots__ = ("buffers", "header")

    def __init__(self, header: bytes, buffers: Sequence[Buffer] = ()) -> None:
        self.header = header
        self.buffers = list(buffers)

    @property
    def nbytes(self) -> int:
        """Size of the framed message in bytes."""
        return (
            _PREFIX.size
            + _LENGTH.size * len(self.buffers)
            + len(self.header)
            + sum(memoryview(buffer).nbytes for buffer in self.buffers)
        )

    def to_bytes(self, lead: bytes = b"", *, sized: bool = False) -> bytes:
        """The framed form (one copy of every buffer), for byte-stream transports.

        ``lead`` goes before it in the same copy (a transport's own frame prefix);
        ``sized`` puts the length of the rest (``lead`` included) before everything, as a
        little-endian uint32, for a transport that delimits frames by length: the whole
        frame then goes to the socket in one write.
        """
        sizes = [memoryview(b).nbytes for b in self.buffers]
        lengths = b"".join([_LENGTH.pack(size) for size in sizes])
        prefix = _PREFIX.pack(MAGIC, len(self.header), len(self.buffers))
        if sized:
            total = len(lead) + len(prefix) + len(lengths) + len(self.header) + sum(sizes)
            lead = _SIZE.pack(total) + lead
        return b"".join([lead, prefix, lengths, self.header, *self.buffers])

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Message:
        """Parse the framed form; buffers are read-only views into ``data``.

        Raises:
            MalformedMessageError: on a bad magic number, truncation or trailing bytes.
        """
        view = memoryview(data).cast("B")
        if view.nbytes < _PREFIX.size:
            raise MalformedMessageError(f"message of {view.nbytes} bytes is truncated")
        magic, header_length, count = _PREFIX.unpack_from(view)
        if magic != MAGIC:
            raise MalformedMessageError(
                f"not an aioautograd RPC message (magic {bytes(magic)!r}, expected {MAGIC!r})"
            )
        if count > MAX_BUFFERS:
            raise MalformedMessageError(
                f"message claims {count} arrays; at most {MAX_BUFFERS} travel in one message"
            )
        offset = _PREFIX.size + _LENGTH.size * count
        if view.nbytes < offset + header_length:
            raise MalformedMessageError("message is truncated (header)")
        lengths = [
            _LENGTH.unpack_from(view, _PREFIX.size + _LENGTH.size * i)[0] for i in range(count)
        ]
        header = bytes(view[offset : offset + header_length])
        offset += header_length
        buffers: list[Buffer] = []
        for length in lengths:
            if view.nbytes < offset + length:
                raise MalformedMessageError("message is truncated (array data)")
            buffers.append(view[offset : offset + length])
            offset += length
        if offset != view.nbytes:
            raise MalformedMessageError(f"{view.nbytes - offset} unexpected bytes after message")
        return cls(header, buffers)

    def snapshot(self) -> Message:
        """A copy that owns writable copies of the buffers (the in-process transport's send)."""
        return Message(self.header, [_copy(buffer) for buffer in self.buffers])


def _copy(buffer: Buffer) -> np.ndarray[Any, Any]:
    # NumPy copies large buffers about twice as fast as bytearray(buffer).
    return np.frombuffer(buffer, dtype=np.uint8).copy()


# ----------------------------------------------------------------------------------- encode


def _dtype_name(dtype: np.dtype[Any]) -> str:
    name = _WIRE_NAMES.get(dtype)
    if name is not None:
        return name
    name = str(dtype.newbyteorder("<").str)
    if name not in _ALLOWED_DTYPES:
        raise TypeError(
            f"cannot send arrays of dtype {dtype} over RPC: only bool, integer, float16/32/64 "
            "and complex64/128 arrays travel (no pickle)"
        )
    return name


def _is_cupy_array(obj: object) -> bool:
    return type(obj).__module__.startswith("cupy") and hasattr(obj, "__cuda_array_interface__")


def _array_ext(index: int) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_ARRAY, _INDEX.pack(index))


_ARRAY_EXTS = [_array_ext(index) for index in range(64)]  # immutable: shared by messages


class _Encoder:
    """Walks a payload with msgpack's ``default`` hook, moving arrays into the table."""

    def __init__(self) -> None:
        self.table: list[list[Any]] = []
        self.buffers: list[Buffer] = []
        self.tensors: list[Tensor] = []
        self.objects: list[Any] = []  # objects encoded through __rpc_encode__ (RRefs, ...)
        self._memo: dict[int, msgpack.ExtType] = {}
        self._keep: list[Any] = []  # keeps memoised objects alive, so their ids stay unique

    def pack(self, obj: Any) -> bytes:
        try:
            packed: bytes = msgpack.packb(
                obj, default=self._default, strict_types=True, use_bin_type=True, datetime=False
            )
            return packed
        except OverflowError as exc:
            raise TypeError(f"cannot send an integer outside the 64-bit range: {exc}") from None

    def _array(self, obj: Any, kind: int, requires_grad: bool = False) -> msgpack.ExtType:
        ext = self._memo.get(id(obj))
        if ext is not None:
            return ext
        if kind == KIND_TENSOR:
            array, device = obj.data, obj.device
        elif _is_cupy_array(obj):
            array, device = obj, parse_device(f"cuda:{obj.device.id}")
        else:
            array, device = np.asarray(obj), CPU
        if device.xp is not np:
            array = array.get()  # CuPy -> host: CUDA data travels through host memory
        dtype = _dtype_name(array.dtype)
        if type(array) is np.ndarray and array.flags.c_contiguous and array.dtype in _WIRE_NAMES:
            host = array  # already what travels: no conversion
        else:
            host = np.asarray(array, dtype=np.dtype(dtype), order="C")  # keeps 0-d arrays 0-d
        index = len(self.table)
        self.table.append([kind, dtype, list(host.shape), str(device), requires_grad])
        self.buffers.append(host.reshape(-1).view(np.uint8))
        ext = _ARRAY_EXTS[index] if index < len(_ARRAY_EXTS) else _array_ext(index)
        self._memo[id(obj)] = ext
        self._keep.append(obj)
        return ext

    def _default(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            if id(obj) not in self._memo:
                self.tensors.append(obj)
            return self._array(obj, KIND_TENSOR, obj.requires_grad)
        if isinstance(obj, tuple):
            return msgpack.ExtType(EXT_TUPLE, self.pack(list(obj)))
        if isinstance(obj, np.ndarray) or _is_cupy_array(obj):
            return self._array(obj, KIND_NDARRAY)
        if isinstance(obj, np.generic):
            return self._array(obj, KIND_SCALAR)
        if isinstance(obj, complex):
            return msgpack.ExtType(EXT_COMPLEX, _COMPLEX.pack(obj.real, obj.imag))
        if isinstance(obj, Device):
            return msgpack.ExtType(EXT_DEVICE, str(obj).encode())
        encode = getattr(type(obj), "__rpc_encode__", None)
        if encode is not None:
            code, fields = encode(obj)
            self.objects.append(obj)
            return msgpack.ExtType(code, self.pack(fields))
        # strict_types sends subclasses here: an IntEnum goes as int, an OrderedDict as dict.
        for base in _PLAIN_TYPES:
            if isinstance(obj, base):
                return base(obj)
        if isinstance(obj, bytearray | memoryview):
            return bytes(obj)
        raise TypeError(
            f"cannot send an object of type {type(obj).__qualname__} over RPC (no pickle): "
            "send tensors, NumPy arrays, numbers, strings, bytes, None, lists, tuples, dicts, "
            "devices, WorkerInfo or RRefs"
        )


def encode(
    fields: dict[str, Any],
    payload: Any,
    on_tensors: Callable[[list[Tensor]], Metadata | None] | None = None,
) -> tuple[Message, list[Any]]:
    """Encode ``payload`` with the routing ``fields`` into a :class:`Message`.

    ``on_tensors`` sees the tensors found in the payload (in table order) and returns the
    metadata to attach (the interceptors' send hook). Returns the message and the objects
    encoded through ``__rpc_encode__`` (the RRefs the agent must register forks for).

    Raises:
        TypeError: for an object or dtype that cannot travel.
    """
    encoder = _Encoder()
    body = encoder.pack(payload)
    if len(encoder.buffers) > MAX_BUFFERS:
        raise TypeError(
            f"cannot send {len(encoder.buffers)} arrays in one RPC message (at most "
            f"{MAX_BUFFERS}): stack them into fewer tensors"
        )
    header = dict(fields)
    if on_tensors is not None:
        metadata = on_tensors(encoder.tensors)
        if metadata:
            header["m"] = metadata
    header["t"] = encoder.table
    header["p"] = body
    return Message(msgpack.packb(header, use_bin_type=True), encoder.buffers), encoder.objects


# ----------------------------------------------------------------------------------- decode


@dataclass(slots=True)
class Header:
    """The validated header of a received message."""

    kind: int
    call_id: int
    src: str
    function: str | None
    rref: tuple[int, int] | None
    timeout: float | None
    metadata: Metadata
    table: list[list[Any]]
    payload: bytes
    error: dict[str, str] | None


def _expect(value: Any, types: tuple[type, ...], what: str) -> Any:
    # bool is an int subclass, but a bool where an int belongs is as malformed as a string.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise MalformedMessageError(f"malformed message: {what} has type {type(value).__name__}")
    return value


def decode_header(message: Message) -> Header:
    """Parse and validate the header (not the payload).

    Raises:
        MalformedMessageError: when the header is not what this version writes.
    """
    try:
        raw = msgpack.unpackb(
            message.header,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_array_len=MAX_BUFFERS,
            max_map_len=_MAX_HEADER_MAP,
        )
    except Exception as exc:
        raise MalformedMessageError(f"malformed message header: {exc}") from None
    # Exact type checks first (msgpack makes exactly these types): the common case costs a
    # few comparisons; anything else goes through _expect, which names what is wrong.
    if type(raw) is not dict:
        _expect(raw, (dict,), "the header")
    get = raw.get
    kind = get("k")
    if kind not in (REQUEST, RESPONSE, ERROR) or type(kind) is not int:
        _expect(kind, (int,), "'k'")
        raise MalformedMessageError(f"malformed message: unknown kind {kind}")
    call_id = get("id")
    if type(call_id) is not int:
        _expect(call_id, (int,), "'id'")
    src = get("src")
    if type(src) is not str:
        _expect(src, (str,), "'src'")
    function = get("fn")
    if kind == REQUEST and type(function) is not str:
        _expect(function, (str,), "'fn'")
    rref = get("rref")
    if rref is not None:
        rref = _expect(rref, (list,), "'rref'")
        if len(rref) != 2 or not all(type(x) is int for x in rref):
            raise MalformedMessageError("malformed message: 'rref' is not two integers")
        rref = (rref[0], rref[1])
    timeout = get("to")
    if timeout is not None:
        timeout = float(_expect(timeout, (int, float), "'to'"))
    error = get("e")
    if kind == ERROR:
        error = _expect(error, (dict,), "'e'")
        for key in ("type", "message", "worker", "traceback"):
            _expect(error.get(key), (str,), f"'e.{key}'")
    table = get("t", [])
    if type(table) is not list:
        _expect(table, (list,), "'t'")
    if len(table) != len(message.buffers):
        raise MalformedMessageError(
            f"malformed message: {len(table)} arrays described, {len(message.buffers)} sent"
        )
    metadata = get("m")
    if metadata is None:
        metadata = {}
    elif type(metadata) is not dict:
        _expect(metadata, (dict,), "'m'")
    payload = get("p", b"\xc0")
    if type(payload) is not bytes:
        _expect(payload, (bytes,), "'p'")
    return Header(kind, call_id, src, function, rref, timeout, metadata, table, payload, error)


def _parse_entry(
    entry: Any, buffer: Buffer
) -> tuple[int, np.dtype[Any], tuple[int, ...], str, bool]:
    # Exact type checks first (msgpack makes exactly these types); anything unusual goes
    # through the checks below, which name what is wrong.
    if type(entry) is list and len(entry) == 5:
        kind, dtype_name, shape, device_name, requires_grad = entry
        dtype = _DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if (
            dtype is not None
            and kind in (KIND_TENSOR, KIND_NDARRAY)
            and type(kind) is int
            and type(shape) is list
            and len(shape) <= _MAX_NDIM
            and all(type(n) is int and n >= 0 for n in shape)
            and type(device_name) is str
            and (requires_grad is False or (requires_grad is True and dtype.kind in "fc"))
            and memoryview(buffer).nbytes == math.prod(shape) * dtype.itemsize
        ):
            return kind, dtype, tuple(shape), device_name, requires_grad
    entry = _expect(entry, (list,), "an array-table entry")
    if len(entry) != 5:
        raise MalformedMessageError("malformed message: array-table entry of wrong length")
    kind, dtype_name, shape, device_name, requires_grad = entry
    if kind not in (KIND_TENSOR, KIND_NDARRAY, KIND_SCALAR):
        raise MalformedMessageError(f"malformed message: unknown array kind {kind!r}")
    dtype = _DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise MalformedMessageError(f"malformed message: dtype {dtype_name!r} is not accepted")
    shape = _expect(shape, (list,), "an array shape")
    if len(shape) > _MAX_NDIM or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise MalformedMessageError(f"malformed message: bad array shape {shape!r}")
    if kind == KIND_SCALAR and shape:
        raise MalformedMessageError("malformed message: a scalar with a shape")
    _expect(device_name, (str,), "an array device")
    if not isinstance(requires_grad, bool) or (requires_grad and dtype.kind not in "fc"):
        raise MalformedMessageError("malformed message: bad requires_grad flag")
    expected = math.prod(shape) * dtype.itemsize
    if memoryview(buffer).nbytes != expected:
        raise MalformedMessageError(
            f"malformed message: array of shape {tuple(shape)} and dtype {dtype} needs "
            f"{expected} bytes, got {memoryview(buffer).nbytes}"
        )
    return kind, dtype, tuple(shape), device_name, requires_grad


def _device(name: str) -> Device:
    known = _DEVICES.get(name)
    if known is not None:
        return known
    try:
        parsed = parse_device(name)
    except ValueError:
        raise MalformedMessageError(f"malformed message: bad device {name!r}") from None
    except RuntimeError as exc:  # e.g. cuda:1 on a process without CuPy or that GPU
        raise RpcError(f"cannot receive an array on {name}: {exc}") from None
    if len(_DEVICES) < 64:
        _DEVICES[name] = parsed
    return parsed


def _array(dtype: np.dtype[Any], shape: tuple[int, ...], buffer: Buffer, device: Device) -> Any:
    view = memoryview(buffer)
    if view.nbytes == 0:
        array = np.empty(shape, dtype)
    else:
        array = np.frombuffer(view, dtype=dtype).reshape(shape)
        if view.readonly:  # bytes from a socket: copy into memory the receiver owns
            array = array.copy()
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    xp = device.xp
    if xp is np:
        return array
    with xp.cuda.Device(device.index):
        return xp.asarray(array)


def decode_payload(
    header: Header,
    message: Message,
    on_tensors: Callable[[list[Tensor]], list[Tensor]] | None = None,
    ext_decoders: dict[int, ExtDecoder] | None = None,
) -> Any:
    """Rebuild the payload of a message whose header :func:`decode_header` validated.

    ``on_tensors`` receives the received tensors (leaves, in table order) and returns the
    tensors to put in their place (the interceptors' receive hook). ``ext_decoders`` rebuild
    the objects that were encoded through ``__rpc_encode__``.

    Raises:
        MalformedMessageError: for anything inconsistent in the table or payload.
        RpcError: for an array on a device this process does not have.
    """
    values: list[Any] = []
    tensor_slots: list[int] = []
    for entry, buffer in zip(header.table, message.buffers, strict=True):
        kind, dtype, shape, device_name, requires_grad = _parse_entry(entry, buffer)
        device = _device(device_name)
        array = _array(dtype, shape, buffer, device)
        if kind == KIND_TENSOR:
            tensor_slots.append(len(values))
            values.append(Tensor(array, device, requires_grad))
        else:
            values.append(array[()] if kind == KIND_SCALAR else array)
    if on_tensors is not None:
        tensors = on_tensors([values[i] for i in tensor_slots])
        if len(tensors) != len(tensor_slots):
            raise RuntimeError("an RPC interceptor changed the number of received tensors")
        for slot, tensor in zip(tensor_slots, tensors, strict=True):
            values[slot] = tensor
    decoders = ext_decoders or {}
    depth = 0
    items = 0

    def count(container: Any) -> Any:
        nonlocal items
        items += len(container)
        if items > MAX_ITEMS:
            raise MalformedMessageError(_TOO_MANY_ITEMS)
        return container

    # Every msgpack item takes a byte at least, nested extensions included (their bytes are
    # part of the payload's): a payload of at most MAX_ITEMS bytes cannot declare more
    # entries than that, and needs no count.
    counter = count if len(header.payload) > MAX_ITEMS else None

    def nested(data: bytes) -> Any:
        # msgpack calls ext_hook from C: unbounded nesting would overflow the C stack.
        nonlocal depth
        if depth >= _MAX_DEPTH:
            raise MalformedMessageError(f"malformed message: nested deeper than {_MAX_DEPTH}")
        depth += 1
        try:
            return _unpack(data, ext_hook, counter)
        finally:
            depth -= 1

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_ARRAY:
            (index,) = _INDEX.unpack(data)
            if index >= len(values):
                raise MalformedMessageError(f"malformed message: array index {index} out of range")
            return values[index]
        if code == EXT_TUPLE:
            return tuple(nested(data))
        if code == EXT_COMPLEX:
            real, imag = _COMPLEX.unpack(data)
            return complex(real, imag)
        if code == EXT_DEVICE:
            return _device(data.decode())
        decoder = decoders.get(code)
        if decoder is None:
            raise MalformedMessageError(f"malformed message: unknown extension type {code}")
        fields = nested(data)
        return decoder(_expect(fields, (list,), f"extension {code}"))

    return _unpack(header.payload, ext_hook, counter)


def _unpack(
    data: bytes, ext_hook: Callable[[int, bytes], Any], count: Callable[[Any], Any] | None
) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            ext_hook=ext_hook,
            list_hook=count,
            object_hook=count,
            strict_map_key=False,
            use_list=True,
            max_array_len=MAX_ITEMS,
            max_map_len=MAX_ITEMS,
        )
    except RpcError:  # includes MalformedMessageError
        raise
    except ValueError as exc:
        if "exceeds max_" in str(exc):  # one container over msgpack's max_array/map_len
            raise MalformedMessageError(_TOO_MANY_ITEMS) from None
        raise MalformedMessageError(
            f"malformed message payload: {type(exc).__name__}: {exc}"
        ) from None
    except Exception as exc:  # msgpack, struct, Unicode and recursion errors alike
        raise MalformedMessageError(
            f"malformed message payload: {type(exc).__name__}: {exc}"
        ) from None
