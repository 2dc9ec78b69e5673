"""How a loader delivers what it streams: its options, and the path of a received batch
to the tensors the loop yields, all of it here::

    PullCall (the transport's)        a puller thread, per call: each message received,
                                      its header parsed, its images a view (no copy) of
                                      the message, or of shared memory (a server on this
                                      host; on the CPU lent to the loop where they lie,
                                      their buffer released once no view is left, else
                                      released once copied)
    Tensors.deliveries(parts)         a batch's parts, once its last arrived:
      assemble                        a batch's parts joined: the one copy of the images,
                                      into pinned memory when bound for a GPU, else into
                                      memory of a batch the loop let go of (BatchMemory;
                                      images on the call's bulk connection are read into
                                      it there); none for a batch lent where it lies
      Tensors._finish                 CPU images normalized here, off the training loop
    Book                              the Delivery waits, in order, for the loop
    Tensors.output(delivery)          the loop: to the device, GPU images normalized there
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from batchwire.client._outputs import TORCH_DTYPES, arrange, unpack
from batchwire.client._transport import BatchwireError, StatusCode
from batchwire.common.batch_codec import DecodedBatch
from batchwire.common.tensors import from_proto
from batchwire.v1 import batchwire_pb2 as pb

__all__ = [
    "Allocator",
    "BatchMemory",
    "Delivery",
    "LoaderOptions",
    "Tensors",
    "TransferStats",
    "assemble",
    "channel_stats",
    "normalize",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """How a loader delivers what it streams (see :class:`RemoteLoader`)."""

    device: torch.device
    normalize: bool = True
    return_ids: bool = False
    prefetch: int = 2
    timeout: float = 300.0
    retry_timeout: float = 60.0
    resolve_every: float = 5.0
    shared_memory: bool = True
    bulk: bool = True

    def __post_init__(self) -> None:
        checks = (
            (self.prefetch >= 1, f"prefetch must be at least 1, got {self.prefetch}"),
            (self.retry_timeout >= 0, f"retry_timeout must be >= 0, got {self.retry_timeout}"),
            (self.resolve_every > 0, f"resolve_every must be positive, got {self.resolve_every}"),
            (self.timeout > 0, f"timeout must be positive, got {self.timeout}"),
            (
                self.device.type != "cuda" or torch.cuda.is_available(),
                f"device={str(self.device)!r} but torch sees no CUDA device; use device='cpu'",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Delivery:
    """One received batch as tensors on the CPU. ``to_normalize``: the images are as
    served and still to be normalized, on the device (``Tensors.output``)."""

    index: int
    ids: np.ndarray
    images: torch.Tensor
    labels: torch.Tensor
    cursor: int
    skipped_ids: tuple[int, ...]
    to_normalize: bool = False
    # A pipeline with named outputs: their heads; ``images`` is then their payload.
    outputs: tuple[pb.Tensor, ...] = ()
    # What the loop yields for it, where that was made off the loop (a batch of named
    # outputs on the CPU, in the puller's thread: unpacked, normalized, arranged).
    ready: tuple[Any, ...] | None = None


@dataclasses.dataclass
class TransferStats:
    """Image payload bytes received, and bytes copied on their way to tensors.

    ``copied == received`` means each payload byte was copied exactly once
    between the bytes gRPC hands over and the tensor the user gets; a batch lent where it
    lies in the server's shared memory adds to ``received`` alone.
    """

    received: int = 0
    copied: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, received: int, copied: int) -> None:
        with self.lock:
            self.received += received
            self.copied += copied

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (spawned DataLoader workers, ddp_spawn) counts from zero.
        return (TransferStats, ())


# allocate(shape, dtype) -> (the tensor, a writable NumPy view of its memory)
Allocator = Callable[[tuple[int, ...], np.dtype], tuple[torch.Tensor, np.ndarray]]


def _numpy_memory(shape: tuple[int, ...], dtype: np.dtype) -> tuple[torch.Tensor, np.ndarray]:
    # NumPy memory, which NumPy backs with huge pages: a fresh torch.empty of a batch
    # costs page faults worth several times the copy.
    array = np.empty(shape, dtype)
    return torch.from_numpy(array), array


# A new buffer's room beyond the batch it is made for, so that a later batch a little
# larger (a detection batch with more boxes) can have it too.
_ROOM = 1 / 8
_PAGE = 4096

_memories: weakref.WeakSet[BatchMemory] = weakref.WeakSet()


class BatchMemory:
    """An allocator of batch memory on the CPU (an :data:`Allocator`) that lends the
    buffers of batches the loop let go of to later batches.

    Fresh memory of a batch's size costs more than the copy into it: the allocator hands
    tens of MB back to the kernel when a batch is freed and maps them again for the
    next, and the kernel zeroes every page at its first touch (measured: 3.4 ms of CPU
    for a 20 MB batch into fresh memory against 1.4 ms into memory used before), so a
    few buffers are kept, as DALI keeps its own output buffers. A buffer goes back when
    nothing refers to its batch any more: not its tensors, nor any view of them (a
    sliced target, a view's NumPy array); what the user keeps is never reused. At most
    ``keep`` wait to be lent; the rest are freed as before. Thread-safe; a forked child
    starts with none."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[np.ndarray] = []  # buffers let go of, each flat uint8
        # Reentrant: a buffer may come back while this thread lends one (a collection of
        # garbage that held the last reference to a batch runs at any allocation).
        self._lock = threading.RLock()
        _memories.add(self)

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[torch.Tensor, np.ndarray]:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buffer = self._lend(nbytes)
        # Through a memoryview, so that NumPy's views of the batch (and torch's tensors of
        # them) keep ``lent`` alive, not the buffer: ``lent`` dies with the batch's last one.
        lent = np.frombuffer(memoryview(buffer)[:nbytes], dtype)  # type: ignore[arg-type]
        weakref.finalize(lent, _give_back, weakref.ref(self), buffer)
        array = lent.reshape(shape)
        return torch.from_numpy(array), array

    def _lend(self, nbytes: int) -> np.ndarray:
        """A free buffer of at least ``nbytes`` and not much more, else a new one."""
        with self._lock:
            most = max(2 * nbytes, _PAGE)  # not a large buffer for a small batch
            fitting = [i for i, free in enumerate(self._free) if nbytes <= free.nbytes <= most]
            if fitting:
                best = min(fitting, key=lambda i: self._free[i].nbytes)
                return self._free.pop(best)
        size = -(-int(nbytes * (1 + _ROOM)) // _PAGE) * _PAGE
        return np.empty(max(size, 1), np.uint8)

    def _take_back(self, buffer: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buffer)

    def _forget(self) -> None:
        """In a forked child: the lock anew (another thread may have held it at the fork),
        and no buffers (the parent's batches are not this process's to reuse)."""
        self._lock = threading.RLock()
        self._free = []


def _give_back(memory: weakref.ref[BatchMemory], buffer: np.ndarray) -> None:
    owner = memory()
    if owner is not None:
        owner._take_back(buffer)


def _after_fork_in_child() -> None:
    for memory in list(_memories):
        memory._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _pinned_memory(shape: tuple[int, ...], dtype: np.dtype) -> tuple[torch.Tensor, np.ndarray]:
    # torch's caching host allocator: the copy to the GPU can be asynchronous.
    tensor = torch.empty(shape, dtype=TORCH_DTYPES[dtype], pin_memory=True)
    return tensor, tensor.numpy()


def assemble(
    parts: list[DecodedBatch],
    allocate: Allocator = _numpy_memory,
    stats: TransferStats | None = None,
    read_images: Callable[[np.ndarray], None] | None = None,
) -> Delivery:
    """One Delivery from a batch's parts: image data copied once, into ``allocate``'d
    memory, so that the one copy from the received bytes is also the last (images the
    server sent on the call's bulk connection are read into it from there:
    ``read_images``, the call's), or not at all where they are lent to the loop (a
    batch in shared memory: its tensors are views of it)."""
    first, last = parts[0].header, parts[-1].header
    views = [p.images for p in parts]
    if len(parts) == 1 and parts[0].lent:
        images, copied = torch.from_numpy(views[0]), 0
    else:
        samples = sum(len(v) for v in views)
        images, out = allocate((samples, *views[0].shape[1:]), views[0].dtype)
        if first.HasField("bulk_images"):
            if read_images is None:
                raise BatchwireError(
                    "the server sent a batch on a bulk connection this call did not offer",
                    code=StatusCode.INTERNAL,
                )
            read_images(out)  # the one copy: from the kernel, into the tensor
        else:
            position = 0
            for view in views:
                out[position : position + len(view)] = view
                position += len(view)
        copied = out.nbytes
    if stats is not None:
        stats.add(sum(v.nbytes for v in views), copied)
    labels = [from_proto(p.header.labels) for p in parts]
    return Delivery(
        index=first.index,
        ids=np.concatenate([np.asarray(p.header.ids, dtype=np.int64) for p in parts]),
        images=images,
        labels=torch.from_numpy(np.concatenate(labels) if labels else np.zeros((0,), np.int64)),
        cursor=last.cursor,
        skipped_ids=tuple(last.skipped_ids),
        to_normalize=not first.normalized,
        outputs=tuple(first.outputs),
    )


def channel_stats(
    mean: Sequence[float], std: Sequence[float], layout: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``mean`` and ``std`` (0..255 pixel scale, as a server announces them) on
    ``device``, shaped to broadcast over a batch in ``layout`` (NCHW or NHWC)."""
    shape = (1, -1, 1, 1) if layout == "NCHW" else (1, 1, 1, -1)
    m = torch.tensor(list(mean) or [0.0], dtype=torch.float32).reshape(shape)
    s = torch.tensor(list(std) or [1.0], dtype=torch.float32).reshape(shape)
    return m.to(device), s.to(device)


def normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """float32, less the mean, over the std (``channel_stats``); an empty batch (every
    sample skipped) only becomes float32, whatever its shape."""
    if not images.numel():
        return images.float()
    return images.float().sub_(mean).div_(std)


class Tensors:
    """A pass's batches, from the messages received to the tensors the loop yields:
    normalized with the pipeline's mean and std (``info``) unless the server normalized
    them or ``normalize`` is off."""

    def __init__(
        self,
        options: LoaderOptions,
        info: pb.PipelineInfo,
        layout: str,
        stats: TransferStats | None = None,
    ) -> None:
        self.options = options
        self.mean, self.std = channel_stats(info.mean, info.std, layout, options.device)
        self._form = info.form
        self._cuda = options.device.type == "cuda"
        # On the CPU, buffers of batches the loop let go of are lent again: as many as
        # the batches of a window (prefetch + 2), the one the loop holds and the next.
        self._allocate = _pinned_memory if self._cuda else BatchMemory(options.prefetch + 4)
        self._stats = stats

    @property
    def lends(self) -> bool:
        """Whether batches in the server's shared memory may be lent to the loop where they
        lie (on the CPU); a GPU's are copied into pinned memory."""
        return not self._cuda

    def deliveries(
        self,
        parts: Iterable[DecodedBatch],
        read_images: Callable[[np.ndarray], None] | None = None,
    ) -> Iterator[Delivery]:
        """Runs in a puller thread: each batch of one call's decoded messages (``parts``:
        a batch in one or more, its images a view valid until the next is taken) once its
        last part arrived, its images copied out (those on the call's bulk connection read
        with ``read_images``)."""
        batch: list[DecodedBatch] = []
        for part in parts:
            if part.header.part != len(batch):
                raise BatchwireError(
                    f"batch {part.header.index}: part {part.header.part} arrived "
                    f"after {len(batch)} parts",
                    code=StatusCode.INTERNAL,
                )
            batch.append(part)
            if len(batch) == (part.header.parts or 1):
                ready = [self._finish(assemble(batch, self._allocate, self._stats, read_images))]
                # Hold nothing of it while suspended: a view of shared memory keeps the
                # server's ring mapped (a batch lent to the loop, its buffer) for as long as
                # this generator, or a traceback of its frame, may be kept.
                batch = []
                del part
                yield ready.pop()

    def _finish(self, d: Delivery) -> Delivery:
        """Labels pinned for a GPU, or CPU images normalized: work kept off the loop (a
        batch of named outputs on the CPU: made wholly ready, image outputs normalized; for
        a GPU they are normalized there, as the loop takes them)."""
        to_normalize = self.options.normalize and d.to_normalize
        if self._cuda:
            return dataclasses.replace(d, labels=d.labels.pin_memory(), to_normalize=to_normalize)
        if d.outputs:
            ready = self._named(dataclasses.replace(d, to_normalize=to_normalize))
            return dataclasses.replace(d, ready=ready, to_normalize=False)
        if to_normalize:
            images = normalize(d.images, self.mean, self.std)
            return dataclasses.replace(d, images=images, to_normalize=False)
        return dataclasses.replace(d, to_normalize=False)

    def output(self, d: Delivery) -> tuple[Any, ...]:
        """What the loop yields for a delivery: on the loader's device, normalized."""
        if d.ready is not None:
            return d.ready
        if d.outputs:
            return self._named(d)
        images, labels = d.images, d.labels
        if self._cuda:
            images = images.to(self.options.device, non_blocking=True)
            labels = labels.to(self.options.device, non_blocking=True)
            if d.to_normalize:
                images = normalize(images, self.mean, self.std)
        labels = labels.reshape(-1)
        if self.options.return_ids:
            return images, labels, torch.from_numpy(np.asarray(d.ids, dtype=np.int64))
        return images, labels

    def _named(self, d: Delivery) -> tuple[Any, ...]:
        """A batch of named outputs as the pipeline's form arranges it (``_outputs``): each
        on the device, image outputs normalized there."""
        device, cuda = self.options.device, self._cuda
        named = unpack(d.images, d.outputs)
        for head in d.outputs:
            value = named[head.name]
            if isinstance(value, list):  # a ragged output's tensors, or a text output's texts
                if cuda:
                    named[head.name] = [
                        v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                        for v in value
                    ]
                continue
            value = value.to(device, non_blocking=True) if cuda else value
            if head.kind == "image" and d.to_normalize and value.dtype == torch.uint8:
                value = normalize(value, self.mean, self.std)
            named[head.name] = value
        labels = d.labels.to(device, non_blocking=True) if cuda else d.labels
        out = arrange(self._form, named, d.outputs, labels.reshape(-1))
        if self.options.return_ids:
            return (*out, torch.from_numpy(np.asarray(d.ids, dtype=np.int64)))
        return out
