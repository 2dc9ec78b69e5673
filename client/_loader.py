"""``RemoteLoader``: a PyTorch iterable over batches streamed by batchwire servers."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import torch
import torch.utils.data

from batchwire.client._channel import ChannelCache, check_target, stub
from batchwire.client._exceptions import (
    BatchwireError,
    InvalidArgumentError,
    error_for,
    from_rpc_error,
)
from batchwire.client._frameworks import (
    distributed_rank_world,
    refuse_accelerate_wrappers,
    worker_id,
)
from batchwire.client._ledger import Ledger, Record
from batchwire.client._normalize import channel_stats
from batchwire.client._pass import StreamPass, close_at_exit
from batchwire.client._reader import Delivery, TransferStats
from batchwire.client._security import ChannelSecurity, PemSource
from batchwire.client._servers import RETRIABLE, Server, ServerSet
from batchwire.common.sampler import Plan
from batchwire.common.stream import StreamSpec
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["LoaderOptions", "RemoteLoader"]

_STATE_VERSION = 2
_READABLE_STATES = (1, 2)  # version 1: saved by batchwire 0.1, same fields and meaning
# A state loads into a loader only if these match (the rank may differ: ranks move in
# lockstep, and frameworks save rank 0's state and load it on every rank).
_IDENTITY = ("dataset", "batch_size", "seed", "shuffle", "drop_last", "world_size")
_TORCH_DTYPES = {
    np.dtype("u1"): torch.uint8,
    np.dtype("<f2"): torch.float16,
    np.dtype("<f4"): torch.float32,
}
_PULL_METHOD = "/batchwire.v1.Batchwire/PullBatches"


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, message)


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


@dataclasses.dataclass(frozen=True)
class _Share:
    """Who this process streams for: a rank of a world (resolved when a pass starts)."""

    rank: int
    world_size: int


class RemoteLoader(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Batches of one dataset, preprocessed by a named pipeline on remote servers.

    ``for images, labels in loader`` yields ``batch_size`` samples at a time
    (``images, labels, ids`` with ``return_ids=True``): images as float32
    normalized with the pipeline's mean/std (``normalize=True``) or as served
    (uint8 NCHW for the presets), labels and ids as int64. Each rank of a DDP
    job gets a disjoint share; every rank gets the same number of batches. The
    order of an epoch depends only on ``(seed, epoch)``.

    Rank and world size are ``rank``/``world_size`` if given, else taken from
    ``torch.distributed`` (the world, or ``process_group``) when a pass starts,
    so a loader may be built before ``init_process_group``. Explicit values
    that disagree with an initialized ``torch.distributed`` raise.

    Each ``iter()`` is a pass: after ``load_state_dict`` it resumes the saved
    epoch at the saved position (the end of an epoch is the start of the next);
    after ``set_epoch(e)`` it starts epoch ``e``
    (keeping the position of a loaded state of epoch ``e``); otherwise it starts
    the epoch after the previous pass's, whether that pass ran to its end or
    was left early. A pass begins when its iterator is first advanced, and
    stops the previous pass of the same loader. ``state_dict()`` counts only
    batches handed out, never prefetched ones; a state saved on one rank loads
    on every rank of the same job.

    ``address`` is ``"host:port"``, a list of them, or ``"dns:///name:port"``
    (every address behind the name, resolved again every ``resolve_every``
    seconds: servers that join take batches within the epoch). Every server streams at once, and
    each is asked for the rank's next batch whenever it has delivered one, so a
    faster server carries more; batches reach the user in order ``k`` whichever
    server carried them. When a server fails or drains, the batches it held are
    asked of the others, and it is tried again with backoff; after
    ``retry_timeout`` seconds without a batch from any server the loop raises.
    When a server stalls without failing, the batches it holds are also asked of
    the others once the loop has waited far longer than batches usually take.

    In ``DataLoader`` workers, worker 0 streams the whole share and the other
    workers end at once, so the order and ``StatefulDataLoader``'s state are
    exact; workers add nothing, since the server does the work.

    Each server is asked for at most ``prefetch + 2`` batches at a time, by
    background threads, and at most ``prefetch + 2 * (prefetch + 2) * servers``
    batches beyond the one taken next are asked for or held: room for the
    faster servers to run ahead while a server at half their speed (or less)
    finishes the batch the loop waits for. A batch that takes longer than ``timeout`` seconds raises
    ``UnavailableError``. Every error is a ``BatchwireError`` with a ``code``.
    ``token``, ``tls_ca``, ``tls_cert`` and ``tls_key`` (PEM paths or bytes)
    authenticate to secured servers. The loader pickles (spawned workers,
    ``ddp_spawn``) without its threads and channels.
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
        resolve_every: float = 5.0,
        token: str | None = None,
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        addresses = (address,) if isinstance(address, str) else tuple(address)
        if not addresses or not all(isinstance(a, str) and a for a in addresses):
            raise _invalid("address must be 'host:port', a gRPC target, or a list of them")
        for target in addresses:
            check_target(target)
        explicit = rank is not None or world_size is not None
        try:
            # The stream every pass asks for (rank, world, epoch and cursor filled in
            # then): validated once, here, and read-only from now on.
            self._spec = StreamSpec(
                dataset=dataset,
                pipeline=pipeline,
                batch_size=batch_size,
                seed=seed,
                shuffle=shuffle,
                drop_last=drop_last,
                rank=rank or 0,
                world_size=1 if world_size is None else world_size,
                dtype=dtype,
                layout=layout,
                params=dict(params or {}),
            )
            self._options = LoaderOptions(
                device=torch.device(device) if device is not None else torch.device("cpu"),
                normalize=normalize,
                return_ids=return_ids,
                prefetch=prefetch,
                timeout=timeout,
                retry_timeout=retry_timeout,
                resolve_every=resolve_every,
            )
        except (ValueError, RuntimeError) as exc:
            raise _invalid(str(exc)) from exc
        self._security = ChannelSecurity.from_options(
            token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        self._addresses = addresses
        self.skipped_ids: list[int] = []
        # Image payload bytes received and copied: one copy each, by design.
        self.transfer = TransferStats()
        self._explicit = _Share(self._spec.rank, self._spec.world_size) if explicit else None
        self._group = process_group
        # The share torch.distributed gave when this loader was pickled: spawned
        # DataLoader workers have no process group of their own.
        self._inherited: _Share | None = None
        self._info: pb.DatasetInfo | None = None
        if lanes is not None:
            warnings.warn(
                "RemoteLoader(lanes=) is ignored: batches go to whichever server is ready",
                DeprecationWarning,
                stacklevel=2,
            )
        self._servers = ServerSet(self._addresses)
        self._channels = ChannelCache(self._security, on_open=close_at_exit)
        self._ledger = Ledger()
        self._pass: StreamPass | None = None
        # load_state_dict ran in this DataLoader worker: see _begin.
        self._loaded_in_worker = False

    # -- settings (read-only: a loader's stream is fixed when it is built) ----------------

    @property
    def addresses(self) -> tuple[str, ...]:
        return self._addresses

    @property
    def spec(self) -> StreamSpec:
        """The stream this loader asks for (rank, world size, epoch and cursor aside)."""
        return self._spec

    @property
    def options(self) -> LoaderOptions:
        return self._options

    dataset_name = property(lambda self: self._spec.dataset, doc="The dataset's name.")
    pipeline = property(lambda self: self._spec.pipeline, doc="The pipeline's name.")
    batch_size = property(lambda self: self._spec.batch_size, doc="Samples per batch.")
    shuffle = property(lambda self: self._spec.shuffle)
    drop_last = property(lambda self: self._spec.drop_last)
    seed = property(lambda self: self._spec.seed)
    dtype = property(lambda self: self._spec.dtype)
    layout = property(lambda self: self._spec.layout)
    params = property(lambda self: dict(self._spec.params))
    device = property(lambda self: self._options.device)
    normalize = property(lambda self: self._options.normalize)
    return_ids = property(lambda self: self._options.return_ids)
    prefetch = property(lambda self: self._options.prefetch)
    timeout = property(lambda self: self._options.timeout)
    retry_timeout = property(lambda self: self._options.retry_timeout)
    resolve_every = property(lambda self: self._options.resolve_every)

    # -- dataset facts -----------------------------------------------------------------

    def _channel(self, server: Server) -> grpc.Channel:
        return self._channels.get(server.address, server.tls_name)

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

    # -- ranks ---------------------------------------------------------------------------

    def _share(self) -> _Share:
        """This process's rank and world size, as of now (see the class docstring)."""
        live = distributed_rank_world(self._group)
        if self._explicit is not None:
            if live is not None and live != (self._explicit.rank, self._explicit.world_size):
                raise _invalid(
                    f"rank={self._explicit.rank}, world_size={self._explicit.world_size} were "
                    f"given, but torch.distributed is initialized with rank {live[0]} of "
                    f"{live[1]}: this process would train on another share than its rank's. "
                    "Leave rank and world_size unset to take them from torch.distributed, or "
                    "pass process_group= to shard over a subgroup"
                )
            return self._explicit
        if live is not None:
            return _Share(*live)
        return self._inherited or _Share(0, 1)

    @property
    def rank(self) -> int:
        return self._share().rank

    @property
    def world_size(self) -> int:
        return self._share().world_size

    def _plan(self, share: _Share, epoch: int, start: int = 0) -> tuple[StreamSpec, Plan]:
        """The stream of ``share`` in ``epoch`` from cursor ``start``, and its plan."""
        try:
            spec = self._spec.replace(
                rank=share.rank, world_size=share.world_size, epoch=epoch, start=start
            )
            plan = spec.plan(self.num_samples)
        except ValueError as exc:
            raise _invalid(str(exc)) from exc
        if plan.num_batches == 0:
            raise _invalid(
                f"batch_size {spec.batch_size} is larger than this rank's share of the "
                f"dataset ({plan.num_samples} samples over {spec.world_size} ranks) and "
                "drop_last=True leaves no batch: every epoch would be empty. Lower batch_size "
                "or pass drop_last=False"
            )
        return spec, plan

    def __len__(self) -> int:
        """Batches per epoch for this rank (equal on every rank)."""
        return self._plan(self._share(), 0)[1].num_batches

    # -- passes and state --------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next pass if none is."""
        return int(self._position(self._ledger.read())[0])

    def set_epoch(self, epoch: int) -> None:
        """The next pass starts ``epoch`` (at the loaded position if a loaded state is
        about to resume ``epoch``, as after ``load_state_dict``)."""
        refuse_accelerate_wrappers()
        if epoch < 0:
            raise _invalid(f"epoch must be >= 0, got {epoch}")
        with self._ledger.update() as record:
            if record.fresh and record.epoch == epoch:
                return
            record.epoch, record.cursor, record.fresh = epoch, 0, True
            record.pass_id, record.in_workers = 0, False

    def _position(self, record: Record) -> tuple[int, int]:
        """(epoch, cursor) after the last batch handed out, or where the next pass starts."""
        current = self._pass
        if current is not None and record.pass_id == current.id:
            if current.cursor == current.share_size:
                return current.epoch + 1, 0  # after the last batch: see _begin
            return current.epoch, current.cursor
        if record.fresh:
            return record.epoch, record.cursor
        return record.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: the position after the last batch handed out
        (prefetched ones don't count), or where the next pass starts.

        ``cursor`` is a position in a rank's share of ``epoch``; it is the same on
        every rank, so the state loads on any rank of the job.
        """
        record = self._ledger.read()
        if worker_id() is None and record.in_workers:
            raise _invalid(
                "this loader's last pass ran in DataLoader worker processes, so this process "
                "cannot tell how many of its batches training has used. Checkpoint through "
                "torchdata's StatefulDataLoader(loader, batch_size=None, num_workers=N) (Lightning "
                "saves its state_dict() itself), or use num_workers=0, where the server does the "
                "work all the same"
            )
        epoch, cursor = self._position(record)
        share = self._share()
        return {
            "version": _STATE_VERSION,
            **self._identity(share),
            "pipeline": self.pipeline,
            "rank": share.rank,
            "epoch": epoch,
            "cursor": cursor,
        }

    def _identity(self, share: _Share) -> dict[str, Any]:
        """The settings a state must share with a loader to load into it (_IDENTITY)."""
        return {
            "dataset": self.dataset_name,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "world_size": share.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next pass continues from ``state``: exactly the rest of its epoch.

        Refuses a state of another dataset, seed, batch size, shuffle, drop_last or
        world size, with a message.
        """
        if state.get("version") not in _READABLE_STATES:
            raise _invalid(
                f"state version {state.get('version')!r} is not one of {_READABLE_STATES}"
            )
        mine = self._identity(self._share())
        for key in _IDENTITY:
            if state.get(key) != mine[key]:
                hint = "create the loader with the same settings to resume"
                if key == "world_size" and distributed_rank_world(self._group) is None:
                    hint = "load it after torch.distributed is initialized"
                raise _invalid(
                    f"state was saved with {key}={state.get(key)!r} but this loader has "
                    f"{key}={mine[key]!r}; {hint}"
                )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or cursor < 0:
            raise _invalid(f"state has epoch={epoch}, cursor={cursor}; both must be >= 0")
        worker = worker_id()
        if worker not in (None, 0):
            return  # workers other than 0 stream nothing (see the class docstring)
        with self._ledger.update() as record:
            record.epoch, record.cursor, record.fresh = epoch, cursor, True
            record.pass_id, record.in_workers = 0, False
        self._loaded_in_worker = worker is not None
        self.skipped_ids = []

    def _begin(self, share: _Share, mean: torch.Tensor, std: torch.Tensor) -> StreamPass:
        """Stop the previous pass, claim the next one in the ledger, start its readers."""
        previous, self._pass = self._pass, None
        if previous is not None:
            previous.supersede()
        worker = worker_id()
        # A state that StatefulDataLoader loaded in this worker is for the pass made right
        # after it here, which uses it up only by running to its end: torchdata primes
        # the prefetch of a restored iterator before it finds the state was of a finished
        # pass and starts another, and that discarded pass must not count.
        tentative, self._loaded_in_worker = self._loaded_in_worker, False
        with self._ledger.update() as record:
            epoch, start = (record.epoch, record.cursor) if record.fresh else (record.epoch + 1, 0)
            spec, plan = self._plan(share, epoch, start)  # validates a loaded cursor
            if 0 < plan.share_size == start:
                # The end of an epoch is the start of the next: frameworks that count
                # batches by len() (Lightning) never ask past the last one, so their
                # checkpoint at an epoch's end is this, and the next pass is a new epoch.
                epoch, start = epoch + 1, 0
                spec, plan = self._plan(share, epoch, start)
            stream_pass = StreamPass(
                epoch=epoch,
                start=start,
                share_size=plan.share_size,
                num_batches=plan.num_batches,
                batch_size=self.batch_size,
                spec=spec.to_proto(),
                open_call=self._open_call,
                servers=self._servers,
                convert=lambda d: self._convert(d, mean, std),
                allocate=self._allocate,
                stats=self.transfer,
                credit=self.prefetch + 2,
                # Twice the servers' credit: with one credit's worth of room, a server at
                # half the others' speed held up the loop (bench --fleet: 0.75 of the sum
                # of the servers' rates, 0.95 with this).
                window=self.prefetch + 2 * (self.prefetch + 2) * len(self._servers.servers()),
                retry_timeout=self.retry_timeout,
                timeout=self.timeout,
                resolve_every=self.resolve_every,
            )
            if not tentative:
                record.epoch, record.cursor, record.fresh = epoch, start, False
            record.pass_id, record.in_workers = stream_pass.id, worker is not None
        if start == 0:
            self.skipped_ids = []
        self._pass = stream_pass
        stream_pass.start_readers()
        return stream_pass

    def _end(self, stream_pass: StreamPass) -> None:
        """A pass that ran to its end: the next one starts the following epoch."""
        with self._ledger.update() as record:
            if record.pass_id == stream_pass.id:
                record.epoch, record.cursor, record.fresh = stream_pass.epoch + 1, 0, True

    # -- iteration ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return self._iterate()

    def _iterate(self) -> Iterator[tuple[torch.Tensor, ...]]:
        # A generator: nothing below runs until the iterator is first advanced, so
        # frameworks that call iter() and drop the result start no pass.
        refuse_accelerate_wrappers()
        if worker_id() not in (None, 0):
            return  # worker 0 streams the whole share, in order
        mean, std = self._stats(self._describe())
        stream_pass = self._begin(self._share(), mean, std)
        try:
            for index in range(stream_pass.first, stream_pass.num_batches):
                delivery = stream_pass.take(index)
                stream_pass.cursor = delivery.cursor
                self.skipped_ids.extend(delivery.skipped_ids)
                if len(delivery.ids) == 0:
                    continue  # every sample of this batch was unreadable
                yield self._output(delivery, mean, std)
            self._end(stream_pass)
        finally:
            stream_pass.stop()

    def _open_call(self, server: Server, requests: Iterator[pb.PullRequest]) -> grpc.Call:
        # Raw message bytes (no deserializer): the puller parses them without copying
        # the image payload (batchwire.common.batch_codec).
        pull = self._channel(server).stream_stream(
            _PULL_METHOD,
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=None,
        )
        return pull(requests, metadata=self._security.metadata())  # type: ignore[no-any-return]

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
        """Stop the pass in progress (cancel its streams, join its readers) and close
        the channels. The loader can be iterated again afterwards."""
        current, self._pass = self._pass, None
        if current is not None:
            current.stop()
        self._channels.close()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """A copy without threads, channels or locks (spawned DataLoader workers,
        ``ddp_spawn``); it carries the share torch.distributed gives here."""
        state = self.__dict__.copy()
        live = distributed_rank_world(self._group)
        state["_inherited"] = _Share(*live) if live is not None else self._inherited
        state["_group"] = None  # process groups don't pickle; the share above stands in
        if self._group is not None and self._explicit is None and live is not None:
            state["_explicit"] = _Share(*live)
        for key in ("_servers", "transfer", "_pass"):
            state[key] = None
        state["_loaded_in_worker"] = False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._servers = ServerSet(self.addresses)
        self.transfer = TransferStats()

    def __repr__(self) -> str:
        return (
            f"RemoteLoader({list(self.addresses)!r}, dataset={self.dataset_name!r}, "
            f"pipeline={self.pipeline!r}, batch_size={self.batch_size})"
        )
