"""A batch of a pipeline with several named outputs, as it travels: one payload.

A pipeline that declares named outputs (a view per crop, boxes per image) makes batches of
several tensors, some with a shape that differs from sample to sample. They travel as one
flat ``uint8`` payload, in the place of a batch's images (``Batch.images``), wherever the
images of a one-output batch go: in the message, in shared memory or on the bulk
connection, unchanged. ``Batch.outputs`` describes each output in it: its name, dtype,
shape, kind, its offset in the payload and, for a ragged output, each sample's length along
its first dimension (the data and lengths of DALI's ``TensorList``).

:func:`pack` lays a batch's outputs out (the server); a client reads them back as views of
the payload (``batchwire.client``), an output's bytes at a multiple of :data:`ALIGN` so
that a view of any dtype is aligned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchwire.common.tensors import to_proto
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["ALIGN", "KINDS", "TEXT_SEPARATOR", "Output", "Payload", "none_of", "pack"]

# Where each output begins in a payload: a multiple of this many bytes.
ALIGN = 16
# What an output may be: pixels (normalized by the client as images are), a tensor of one
# shape per sample, a tensor whose first dimension varies from sample to sample, or text
# (each sample's UTF-8 bytes, ragged; several texts of a sample joined by TEXT_SEPARATOR).
KINDS = ("image", "tensor", "ragged", "text")
TEXT_SEPARATOR = b"\x00"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Output:
    """One output of a batch: ``data`` a batch array ``(samples, ...)``, or for a ragged
    output the samples' arrays, which may differ in their first dimension."""

    name: str
    kind: str
    data: np.ndarray | Sequence[np.ndarray]
    layout: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"output {self.name!r}: kind must be one of {KINDS}, not {self.kind!r}"
            )


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class Payload:
    """A batch's named outputs laid out as one flat uint8 payload, not yet copied: each
    output's data lies where it was made (DALI's buffers, valid while the batch's
    ``finish`` runs), and is copied once, to wherever the payload goes (:meth:`copy_into`:
    a message, shared memory, a bulk connection's buffer). As an array (``np.asarray``) it
    is copied into memory of its own."""

    dtype = np.dtype(np.uint8)
    ndim = 1

    def __init__(self, pieces: Sequence[tuple[int, np.ndarray]], nbytes: int) -> None:
        self._pieces = tuple(pieces)
        self.nbytes = self.size = nbytes
        self.shape = (nbytes,)

    def __len__(self) -> int:
        return self.nbytes

    def copy_into(self, out: np.ndarray) -> None:
        """Copy the payload into ``out`` (``nbytes`` bytes, any dtype: its memory is
        written byte for byte); the alignment's padding is zeroed."""
        flat = out.reshape(-1).view(np.uint8)
        at = 0
        for start, data in self._pieces:
            flat[at:start] = 0
            end = start + data.nbytes
            np.copyto(flat[start:end], np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            at = end
        flat[at:] = 0

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = np.empty(self.nbytes, np.uint8)
        self.copy_into(array)
        return array if dtype is None else array.astype(dtype)


def pack(outputs: Sequence[Output]) -> tuple[Payload, tuple[pb.Tensor, ...]]:
    """The payload of ``outputs`` (nothing copied yet: :class:`Payload`) and their heads
    for ``Batch.outputs``, in order. A ragged output's samples lie one after the other."""
    heads: list[pb.Tensor] = []
    pieces: list[tuple[int, np.ndarray]] = []
    offset = 0
    for output in outputs:
        if output.kind in ("ragged", "text"):
            samples = [np.ascontiguousarray(a) for a in output.data]
            lengths = [len(a) if a.ndim else 1 for a in samples]
            rest = next((a.shape[1:] for a in samples if a.ndim), ())
            dtype = samples[0].dtype if samples else np.dtype(np.float32)
            shape = (sum(lengths), *rest)
            parts = [a.reshape(-1, *rest) for a in samples]
        else:
            data = np.asarray(output.data)
            dtype, shape, lengths, parts = data.dtype, data.shape, [], [data]
        head = to_proto(output.name, np.zeros((0,), dtype), output.layout)
        del head.shape[:]
        head.shape.extend(shape)
        head.offset, head.kind = offset, output.kind
        head.lengths.extend(lengths)
        heads.append(head)
        at = offset
        for part in parts:
            pieces.append((at, part))
            at += part.nbytes
        offset = _aligned(at)
    return Payload(pieces, offset), tuple(heads)


def none_of(heads: Sequence[pb.Tensor]) -> tuple[pb.Tensor, ...]:
    """The heads of an empty batch of the outputs ``heads`` describe (a batch whose every
    sample was left out): no samples, each output's other dimensions kept."""
    empty = []
    for head in heads:
        none = pb.Tensor(name=head.name, dtype=head.dtype, layout=head.layout, kind=head.kind)
        none.shape.extend([0, *head.shape[1:]])
        empty.append(none)
    return tuple(empty)
