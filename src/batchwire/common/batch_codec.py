"""``Batch`` messages with their image payload copied once on each side.

The bytes on the wire are an ordinary ``batchwire.v1.Batch`` protobuf that any
language parses. What differs is how this package builds and reads them:
protobuf's Python runtime copies a ``bytes`` field when it parses a message and
again each time the field is read, and again when a message is built and
serialized. For a 77 MB batch those copies cost more CPU than the network.

* ``encode_batch`` serializes everything except the image data with protobuf
  and splices the data in as field ``images.data``: one copy, into the message.
* ``decode_batch`` walks the top-level fields of the raw message (tags and
  lengths only), parses the small fields with protobuf, and returns the image
  data as a read-only NumPy view into the received bytes: no copy. The caller
  copies it once, into the tensor it hands to the user.
* A batch sent through shared memory (to a client on the server's host) has
  ``shared_images`` set and no ``images.data``: ``decode_batch`` views its
  images where ``shared_images`` says they lie, and the caller copies them out.
* A batch whose images follow on the call's bulk connection has ``bulk_images``
  set and no ``images.data``: ``decode_batch`` gives their dtype and shape (a
  view of no memory), and the caller reads them from the connection.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from batchwire.common.outputs import Payload
from batchwire.common.tensors import DTYPES, to_proto
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["DecodedBatch", "SharedView", "decode_batch", "encode_batch", "fill", "images_head"]

_LENGTH_DELIMITED = 2
_BATCH_IMAGES = pb.Batch.DESCRIPTOR.fields_by_name["images"].number
_TENSOR_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buffer: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(buffer) or shift > 63:
            raise ValueError("truncated or malformed varint in a Batch message")
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _fields(buffer: memoryview) -> Iterator[tuple[int, int, int, int]]:
    """(field number, start of the field's tag, start of its value, end) per field."""
    position = 0
    while position < len(buffer):
        start = position
        tag, position = _read_varint(buffer, position)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, position = _read_varint(buffer, position)
            yield number, start, start, position
            continue
        if wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, value = _read_varint(buffer, position)
            position = value + length
            if position > len(buffer):
                raise ValueError("a field runs past the end of the Batch message")
            yield number, start, value, position
            continue
        else:
            raise ValueError(f"unsupported wire type {wire_type} in a Batch message")
        if position > len(buffer):
            raise ValueError("a field runs past the end of the Batch message")
        yield number, start, start, position


def _split(buffer: memoryview, wanted: int) -> tuple[bytes, tuple[int, int] | None]:
    """The message without field ``wanted`` (copied: it is small) and where that
    field's value lies in ``buffer`` (start, end)."""
    rest: list[memoryview] = []
    found: tuple[int, int] | None = None
    for number, start, value, end in _fields(buffer):
        if number == wanted and found is None and value != start:
            found = (value, end)
        else:
            rest.append(buffer[start:end])
    return b"".join(rest), found


def fill(out: np.ndarray, images: np.ndarray | Payload) -> None:
    """Copy a batch's ``images`` (an array, or the :class:`~batchwire.common.outputs.Payload`
    of its named outputs) into ``out``, which holds as many bytes, viewed as their dtype
    and shape: the one copy of its pixels, into a message, shared memory or a buffer."""
    if isinstance(images, Payload):
        images.copy_into(out)
    else:
        np.copyto(out.view(images.dtype).reshape(images.shape), images)


def images_head(images: np.ndarray | Payload, layout: str) -> pb.Tensor:
    """The images Tensor of ``images`` without its data: name, dtype, shape, layout."""
    tensor = to_proto("images", np.zeros((0,), images.dtype), layout)
    del tensor.shape[:]
    tensor.shape.extend(images.shape)
    return tensor


def encode_batch(header: pb.Batch, images: np.ndarray | Payload, layout: str) -> bytes:
    """``header`` (every field but images) plus ``images`` (an array, or the
    :class:`~batchwire.common.outputs.Payload` of a batch's named outputs), as Batch
    message bytes. The images are copied once, into the message, without the interpreter
    lock where they are large (:func:`_filled_bytes`)."""
    tensor = images_head(images, layout)
    tensor_head = tensor.SerializeToString()
    data_key = _varint(_TENSOR_DATA << 3 | _LENGTH_DELIMITED) + _varint(images.nbytes)
    tensor_length = len(tensor_head) + len(data_key) + images.nbytes
    images_key = _varint(_BATCH_IMAGES << 3 | _LENGTH_DELIMITED) + _varint(tensor_length)
    head = b"".join((header.SerializeToString(), images_key, tensor_head, data_key))
    if isinstance(images, Payload):
        return _filled_bytes(head, images)
    # The bytes as a flat uint8 view (no copy); memoryview.cast refuses an empty batch's
    # zero-length dimension.
    data = np.ascontiguousarray(images).reshape(-1).view(np.uint8)
    if len(data) < _UNLOCKED_COPY_BYTES:
        return b"".join((head, memoryview(data)))  # type: ignore[arg-type]  # a buffer
    return _filled_bytes(head, data)


# From this many bytes of images on, a message is filled with the interpreter lock released.
_UNLOCKED_COPY_BYTES = 1 << 20

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype = ctypes.c_void_p
_bytes_address.argtypes = (ctypes.py_object,)


def _filled_bytes(head: bytes, data: np.ndarray | Payload) -> bytes:
    """``head + data`` as a new bytes object, ``data`` copied by NumPy, which releases the
    interpreter lock while it copies: the server's event loop writes other streams'
    messages meanwhile (``bytes.join`` holds the lock for the whole copy). The object is
    made as C code makes one it fills, ``PyBytes_FromStringAndSize(NULL, n)``, and is
    written only before anything else sees it, as the C API allows."""
    size = len(head) + data.nbytes
    message = _new_bytes(None, size)
    out = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(_bytes_address(message)))
    out[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    fill(out[len(head) :], data)
    return message  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class DecodedBatch:
    """A received Batch: ``header`` has every field but ``images.data``; ``images``
    is a read-only view into the received bytes (copy it before they go away), or,
    ``lent``, memory the loop may keep: the server's shared memory, lent until no view
    of it is left."""

    header: pb.Batch
    images: np.ndarray
    layout: str
    lent: bool = False


# shared(where, dtype, count) -> the images as a flat read-only view of the shared memory
SharedView = Callable[[pb.SharedImages, np.dtype, int], np.ndarray]


def decode_batch(raw: bytes, shared: SharedView | None = None) -> DecodedBatch:
    """Parse Batch message bytes without copying the image data. Images that lie in
    shared memory (``Batch.shared_images``) are viewed there with ``shared``."""
    buffer = memoryview(raw)
    header_bytes, images_span = _split(buffer, _BATCH_IMAGES)
    header = pb.Batch.FromString(header_bytes)
    if images_span is None:
        return DecodedBatch(header, np.zeros((0,), np.uint8), "NCHW")
    images_start, images_end = images_span
    tensor_bytes, data_span = _split(buffer[images_start:images_end], _TENSOR_DATA)
    tensor = pb.Tensor.FromString(tensor_bytes)
    dtype = DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"unknown images dtype {tensor.dtype}")
    shape = tuple(tensor.shape)
    count = int(np.prod(shape, dtype=np.int64))
    if header.HasField("bulk_images"):
        if data_span is not None or header.HasField("shared_images"):
            raise ValueError("a batch on the bulk connection that also carries its images")
        if header.bulk_images.length != count * dtype.itemsize:
            raise ValueError(
                f"images: {header.bulk_images.length} bytes do not hold shape {shape} of {dtype}"
            )
        placeholder = np.broadcast_to(np.zeros((), dtype), shape)  # shape and dtype only
        return DecodedBatch(header, placeholder, tensor.layout or "NCHW")
    if header.HasField("shared_images"):
        where = header.shared_images
        if shared is None or data_span is not None:
            raise ValueError("a batch in shared memory that this client did not ask for")
        if where.length != count * dtype.itemsize:
            raise ValueError(f"images: {where.length} bytes do not hold shape {shape} of {dtype}")
        return DecodedBatch(
            header, shared(where, dtype, count).reshape(shape), tensor.layout or "NCHW"
        )
    start, end = (0, 0) if data_span is None else data_span
    if end - start != count * dtype.itemsize:
        raise ValueError(f"images: {end - start} bytes do not hold shape {shape} of {dtype}")
    layout = tensor.layout or "NCHW"
    if count == 0:
        return DecodedBatch(header, np.zeros(shape, dtype), layout)
    view = np.frombuffer(raw, dtype=dtype, count=count, offset=images_start + start)
    return DecodedBatch(header, view.reshape(shape), layout)
