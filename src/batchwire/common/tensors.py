"""Dense arrays on the wire: ``batchwire.v1.Tensor`` <-> NumPy.

A Tensor's ``data`` is the C-contiguous, little-endian bytes of the array;
``dtype`` and ``shape`` say how to read them. Any language can decode it.
"""

from __future__ import annotations

import numpy as np

from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["DTYPES", "from_proto", "to_proto"]

# Wire dtype <-> NumPy dtype (always little-endian on the wire).
DTYPES: dict[pb.DType, np.dtype] = {
    pb.UINT8: np.dtype("u1"),
    pb.INT32: np.dtype("<i4"),
    pb.INT64: np.dtype("<i8"),
    pb.FLOAT16: np.dtype("<f2"),
    pb.FLOAT32: np.dtype("<f4"),
}
_WIRE = {dtype: wire for wire, dtype in DTYPES.items()}


def to_proto(name: str, array: np.ndarray, layout: str = "") -> pb.Tensor:
    """Encode ``array`` (any byte order; copied once into the message)."""
    wire = _WIRE.get(array.dtype.newbyteorder("<"))
    if wire is None:
        raise TypeError(f"dtype {array.dtype} cannot travel as a batchwire Tensor")
    data = np.ascontiguousarray(array, dtype=DTYPES[wire])
    return pb.Tensor(name=name, dtype=wire, shape=data.shape, data=data.tobytes(), layout=layout)


def from_proto(tensor: pb.Tensor) -> np.ndarray:
    """Decode a Tensor into a writable array that owns its memory."""
    dtype = DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"unknown Tensor dtype {tensor.dtype} in tensor {tensor.name!r}")
    shape = tuple(tensor.shape)
    data = tensor.data
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"tensor {tensor.name!r}: {len(data)} bytes do not hold shape {shape} of {dtype}"
        )
    # bytearray: one copy that the caller owns and may write to.
    return np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
