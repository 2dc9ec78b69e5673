"""``RemoteLoader``: a PyTorch iterable over batches streamed by batchwire servers."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import torch
import torch.utils.data

from batchwire.client._channel import open_channel, stub
from batchwire.client._exceptions import (
    BatchwireError,
    InvalidArgumentError,
    UnavailableError,
    error_for,
    from_rpc_error,
)
from batchwire.client._normalize import channel_stats
from batchwire.client._reader import END, Delivery, LaneReader, TransferStats
from batchwire.client._security import ChannelSecurity, PemSource
from batchwire.client._servers import RETRIABLE, Server, ServerSet
from batchwire.common.sampler import Plan
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["RemoteLoader"]

_STATE_VERSION = 1
_JOIN_TIMEOUT = 5.0
_DTYPES = {"uint8": pb.UINT8, "float16": pb.FLOAT16, "float32": pb.FLOAT32}
_TORCH_DTYPES = {
    np.dtype("u1"): torch.uint8,
    np.dtype("<f2"): torch.float16,
    np.dtype("<f4"): torch.float32,
}
_STREAM_METHOD = "/batchwire.v1.Batchwire/StreamBatches"
_LAYOUTS = {"NCHW": pb.NCHW, "NHWC": pb.NHWC}


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _distributed_rank_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RemoteLoader(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Batches of one dataset, preprocessed by a named pipeline on remote servers.

    ``for images, labels in loader`` yields ``batch_size`` samples at a time
    (``images, labels, ids`` with ``return_ids=True``): images as float32
    normalized with the pipeline's mean/std (``normalize=True``) or as served
    (uint8 NCHW for the presets), labels and ids as int64. Each rank of a DDP
    job (``rank``/``world_size``, detected from ``torch.distributed`` when it
    is initialized) gets a disjoint share; every rank gets the same number of
    batches. The order of an epoch depends only on ``(seed, epoch)``.

    ``address`` is ``"host:port"``, a list of them, or ``"dns:///name:port"``
    (every address behind the name). The rank's batches are split into
    ``lanes`` (default: one per server), streamed concurrently; batch ``k``
    travels in lane ``k % lanes`` and batches reach the user in order ``k``,
    so the sequence never depends on the servers or lanes. When a server
    fails or drains, its lanes continue on the others from the cursor of the
    last batch received, with backoff; after ``retry_timeout`` seconds without
    progress the loop raises.

    Iteration resumes where the last delivered batch left off; after a full
    epoch the loader moves to the next epoch. ``set_epoch(e)`` chooses the
    epoch (keeping the position when ``e`` is the current epoch), and
    ``state_dict()`` / ``load_state_dict()`` save and restore the position.
    Since delivery is in order, one cursor is every lane's position: a state
    loads into a loader with other servers or lanes and continues exactly once.

    Up to ``prefetch`` batches per lane are read ahead by a background thread;
    a batch that takes longer than ``timeout`` seconds raises
    ``UnavailableError``. Every error is a ``BatchwireError`` with a ``code``.
    ``token``, ``tls_ca``, ``tls_cert`` and ``tls_key`` (PEM paths or bytes)
    authenticate to secured servers.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        dataset: str,
        pipeline: str = "train",
        batch_size: int = 256,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | torch.device | None = None,
        normalize: bool = True,
        return_ids: bool = False,
        prefetch: int = 2,
        lanes: int | None = None,
        params: Mapping[str, float] | None = None,
        dtype: str = "uint8",
        layout: str = "NCHW",
        timeout: float = 300.0,
        retry_timeout: float = 60.0,
        token: str | None = None,
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
    ) -> None:
        super().__init__()
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses or not all(isinstance(a, str) and a for a in addresses):
            raise _invalid("address must be 'host:port', a gRPC target, or a list of them")
        if not dataset:
            raise _invalid("dataset must be named")
        if rank is None and world_size is None:
            rank, world_size = _distributed_rank_world()
        rank = 0 if rank is None else rank
        world_size = 1 if world_size is None else world_size
        checks = (
            (batch_size >= 1, f"batch_size must be at least 1, got {batch_size}"),
            (world_size >= 1, f"world_size must be at least 1, got {world_size}"),
            (
                0 <= rank < world_size,
                f"rank must be in [0, world_size), got {rank} of {world_size}",
            ),
            (seed >= 0, f"seed must be >= 0, got {seed}"),
            (prefetch >= 1, f"prefetch must be at least 1, got {prefetch}"),
            (lanes is None or lanes >= 1, f"lanes must be at least 1, got {lanes}"),
            (retry_timeout >= 0, f"retry_timeout must be >= 0, got {retry_timeout}"),
            (timeout > 0, f"timeout must be positive, got {timeout}"),
            (dtype in _DTYPES, f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}"),
            (layout in _LAYOUTS, f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}"),
        )
        for ok, message in checks:
            if not ok:
                raise _invalid(message)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise _invalid(f"device={device!r} but torch sees no CUDA device; use device='cpu'")
        self._security = ChannelSecurity.from_options(
            token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        self.addresses = tuple(addresses)
        self.dataset_name = dataset
        self.pipeline = pipeline
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.normalize = normalize
        self.return_ids = return_ids
        self.prefetch = prefetch
        self._lanes = lanes
        self.retry_timeout = retry_timeout
        self.params = dict(params or {})
        self.dtype = dtype
        self.layout = layout
        self.timeout = timeout
        self.skipped_ids: list[int] = []
        # Image payload bytes received and copied: one copy each, by design.
        self.transfer = TransferStats()
        self._epoch = 0
        self._cursor = 0
        self._info: pb.DatasetInfo | None = None
        self._servers = ServerSet(self.addresses)
        self._channels: dict[Server, grpc.Channel] = {}
        self._pid = -1
        self._active_stop: threading.Event | None = None

    # -- dataset facts -----------------------------------------------------------------

    def _channel(self, server: Server) -> grpc.Channel:
        # Channels are opened lazily and again after a fork (DataLoader workers).
        if self._pid != os.getpid():
            self._channels = {}
            self._pid = os.getpid()
        channel = self._channels.get(server)
        if channel is None:
            channel = open_channel(server.address, self._security, tls_name=server.tls_name)
            self._channels[server] = channel
        return channel

    def _describe(self) -> pb.DatasetInfo:
        """The dataset as the first server that answers describes it (cached)."""
        if self._info is not None:
            return self._info
        error: BatchwireError | None = None
        for lane in range(len(self._servers.servers())):
            server = self._servers.pick(lane)
            try:
                info = stub(self._channel(server)).DescribeDataset(
                    pb.DescribeDatasetRequest(dataset=self.dataset_name),
                    timeout=self.timeout,
                    metadata=self._security.metadata(),
                )
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, server.address)
                error.__cause__ = exc
                if error.code not in RETRIABLE:
                    raise error from exc
                self._servers.mark_failed(server)
                continue
            if not any(p.name == self.pipeline for p in info.pipelines):
                known = ", ".join(p.name for p in info.pipelines)
                raise error_for(
                    grpc.StatusCode.NOT_FOUND,
                    f"server {server.address} has no pipeline {self.pipeline!r} (it has: {known})",
                )
            self._info = info
            return info
        assert error is not None
        raise error

    @property
    def num_samples(self) -> int:
        """Samples in the whole dataset (all ranks)."""
        return int(self._describe().num_samples)

    @property
    def classes(self) -> list[str]:
        """Class names by label, from the dataset's manifest."""
        return list(self._describe().classes)

    def _plan(self, start: int = 0, lanes: int = 1, lane: int = 0) -> Plan:
        return Plan(
            num_samples=self.num_samples,
            batch_size=self.batch_size,
            seed=self.seed,
            epoch=self._epoch,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            rank=self.rank,
            world_size=self.world_size,
            lanes=lanes,
            lane=lane,
            start=start,
        )

    def __len__(self) -> int:
        """Batches per epoch for this rank (equal on every rank)."""
        return self._plan().num_batches

    # -- epochs and state --------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Stream ``epoch`` next; a new epoch starts at its beginning."""
        if epoch < 0:
            raise _invalid(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch = epoch
            self._cursor = 0

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out (prefetched ones don't count).

        ``cursor`` is a position in this rank's share of ``epoch``; every lane
        resumes from it, whatever the number of lanes or servers.
        """
        return {
            "version": _STATE_VERSION,
            "dataset": self.dataset_name,
            "pipeline": self.pipeline,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": self._epoch,
            "cursor": self._cursor,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a ``state_dict()``: exactly the rest of that epoch comes next."""
        if state.get("version") != _STATE_VERSION:
            raise _invalid(f"state version {state.get('version')!r} is not {_STATE_VERSION}")
        for key in ("dataset", "batch_size", "seed", "shuffle", "drop_last", "rank", "world_size"):
            mine = self.dataset_name if key == "dataset" else getattr(self, key)
            if state.get(key) != mine:
                raise _invalid(
                    f"state was saved with {key}={state.get(key)!r} but this loader has "
                    f"{key}={mine!r}; create the loader with the same settings to resume"
                )
        self._epoch = int(state["epoch"])
        self._cursor = int(state["cursor"])
        self.skipped_ids = []

    # -- iteration ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return self._iterate()

    def _iterate(self) -> Iterator[tuple[torch.Tensor, ...]]:
        info = self._describe()
        plan = self._plan(start=self._cursor)
        if self._cursor >= plan.share_size and plan.share_size > 0:
            self.set_epoch(self._epoch + 1)
            plan = self._plan()
        if plan.start == 0:
            self.skipped_ids = []
        lanes = self._lanes or len(self._servers.servers())
        mine = range(lanes)
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            # Inside DataLoader workers: worker w streams lane w only, and the
            # DataLoader's round-robin over workers restores the batch order.
            lanes, mine = worker.num_workers, range(worker.id, worker.id + 1)
        mean, std = self._stats(info)
        stop = threading.Event()
        self._active_stop = stop
        queues: dict[int, queue.Queue[object]] = {}
        readers: dict[int, LaneReader] = {}
        try:
            for lane in mine:
                queues[lane] = queue.Queue(maxsize=self.prefetch)
                readers[lane] = LaneReader(
                    lane=lane,
                    start=plan.start,
                    open_stream=self._opener(lanes, lane),
                    servers=self._servers,
                    out=queues[lane],
                    convert=lambda d: self._convert(d, mean, std),
                    stop=stop,
                    retry_timeout=self.retry_timeout,
                    allocate=self._allocate,
                    stats=self.transfer,
                )
                readers[lane].start()
            first = plan.start // self.batch_size
            for index in range(first, plan.num_batches):
                lane = index % lanes
                if lane not in queues:
                    continue
                delivery = self._take(queues[lane], index)
                self._cursor = delivery.cursor
                self.skipped_ids.extend(delivery.skipped_ids)
                if len(delivery.ids) == 0:
                    continue  # every sample of this batch was unreadable
                yield self._output(delivery, mean, std)
            if worker is None:
                self.set_epoch(self._epoch + 1)
        finally:
            stop.set()
            for reader in readers.values():
                reader.cancel()
            for reader in readers.values():
                reader.join(_JOIN_TIMEOUT)

    def _opener(self, lanes: int, lane: int) -> Callable[[Server, int], grpc.Call]:
        """How a lane opens (and after a failure re-opens) its stream from a cursor."""
        metadata = self._security.metadata()

        def open_stream(server: Server, start: int) -> grpc.Call:
            plan = self._plan(start, lanes, lane)
            request = pb.StreamBatchesRequest(
                dataset=self.dataset_name,
                pipeline=self.pipeline,
                batch_size=plan.batch_size,
                seed=plan.seed,
                epoch=plan.epoch,
                shuffle=plan.shuffle,
                drop_last=plan.drop_last,
                rank=plan.rank,
                world_size=plan.world_size,
                start=plan.start,
                lanes=plan.lanes,
                lane=plan.lane,
                dtype=_DTYPES[self.dtype],
                layout=_LAYOUTS[self.layout],
                params=self.params,
            )
            # Raw message bytes (no deserializer): the reader parses them without
            # copying the image payload (batchwire.common.batch_codec).
            stream = self._channel(server).unary_stream(
                _STREAM_METHOD,
                request_serializer=pb.StreamBatchesRequest.SerializeToString,
                response_deserializer=None,
            )
            return stream(request, metadata=metadata)  # type: ignore[no-any-return]

        return open_stream

    def _take(self, lane_queue: queue.Queue[object], index: int) -> Delivery:
        try:
            item = lane_queue.get(timeout=self.timeout)
        except queue.Empty:
            raise UnavailableError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no batch arrived within {self.timeout:.0f}s (timeout=); the server may be "
                "overloaded or stuck",
            ) from None
        if isinstance(item, BatchwireError):
            raise item
        if item is END or not isinstance(item, Delivery) or item.index != index:
            got = "the end of the stream" if item is END else f"batch {getattr(item, 'index', '?')}"
            raise BatchwireError(
                grpc.StatusCode.INTERNAL, f"expected batch {index} but received {got}"
            )
        return item

    # -- tensors -----------------------------------------------------------------------

    def _stats(self, info: pb.DatasetInfo) -> tuple[torch.Tensor, torch.Tensor]:
        spec = next(p for p in info.pipelines if p.name == self.pipeline)
        return channel_stats(spec.mean, spec.std, self.layout, self.device)

    def _allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[object, np.ndarray]:
        """Where a batch's images are assembled, so that the one copy from the received
        bytes is also the last: pinned memory (torch's caching host allocator) when
        bound for a GPU; otherwise NumPy memory, which NumPy backs with huge pages:
        a fresh torch.empty of a batch costs page faults worth several times the copy."""
        if self.device.type == "cuda":
            tensor = torch.empty(shape, dtype=_TORCH_DTYPES[dtype], pin_memory=True)
            return tensor, tensor.numpy()
        array = np.empty(shape, dtype)
        return torch.from_numpy(array), array

    def _convert(self, d: Delivery, mean: torch.Tensor, std: torch.Tensor) -> Delivery:
        """Runs in the reader thread: labels to tensors, CPU images normalized early."""
        images: torch.Tensor = d.images  # type: ignore[assignment]
        labels = torch.from_numpy(d.labels)  # type: ignore[arg-type]
        if self.device.type == "cuda":
            labels = labels.pin_memory()
        elif self.normalize and not d.normalized and images.numel():
            images = images.float().sub_(mean).div_(std)
        return Delivery(
            index=d.index,
            ids=d.ids,
            images=images,
            labels=labels,
            cursor=d.cursor,
            skipped_ids=d.skipped_ids,
            normalized=d.normalized or (self.normalize and self.device.type != "cuda"),
            layout=d.layout,
        )

    def _output(
        self, d: Delivery, mean: torch.Tensor, std: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        images: torch.Tensor = d.images  # type: ignore[assignment]
        labels: torch.Tensor = d.labels  # type: ignore[assignment]
        if self.device.type == "cuda":
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            if self.normalize and not d.normalized:
                images = images.float().sub_(mean).div_(std)
        labels = labels.reshape(-1)
        if self.return_ids:
            return images, labels, torch.from_numpy(np.asarray(d.ids, dtype=np.int64))
        return images, labels

    # -- life cycle --------------------------------------------------------------------

    def close(self) -> None:
        """Stop any stream in progress and close the channels."""
        if self._active_stop is not None:
            self._active_stop.set()
        for channel in self._channels.values():
            channel.close()
        self._channels = {}

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RemoteLoader({list(self.addresses)!r}, dataset={self.dataset_name!r}, "
            f"pipeline={self.pipeline!r}, batch_size={self.batch_size}, rank={self.rank}, "
            f"world_size={self.world_size}, epoch={self._epoch})"
        )
