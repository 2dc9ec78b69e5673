"""``RemoteLoader``: a PyTorch iterable over batches streamed by batchwire servers."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
import torch
import torch.utils.data

from batchwire.client._delivery import LoaderOptions, Tensors, TransferStats
from batchwire.client._exceptions import (
    BatchwireError,
    InvalidArgumentError,
)
from batchwire.client._frameworks import (
    distributed_rank_world,
    refuse_accelerate_wrappers,
    worker_id,
)
from batchwire.client._ledger import Ledger
from batchwire.client._pass import StreamPass, close_at_exit
from batchwire.client._security import ChannelSecurity, PemSource
from batchwire.client._servers import ServerSet
from batchwire.client._state import Rank, Resumable
from batchwire.client._transport import Transport, check_target, describe_dataset
from batchwire.common.sampler import Plan
from batchwire.common.stream import StreamSpec
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["LoaderOptions", "RemoteLoader"]

# RemoteLoader's arguments that become its StreamSpec's and its LoaderOptions' fields as
# they are (rank, world_size, params and device are converted first).
_SPEC_ARGUMENTS = (
    "dataset",
    "pipeline",
    "batch_size",
    "seed",
    "shuffle",
    "drop_last",
    "dtype",
    "layout",
)
_OPTION_ARGUMENTS = (
    "normalize",
    "return_ids",
    "prefetch",
    "timeout",
    "retry_timeout",
    "resolve_every",
)


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message)


def _targets(address: str | Sequence[str]) -> tuple[str, ...]:
    addresses = (address,) if isinstance(address, str) else tuple(address)
    if not addresses or not all(isinstance(a, str) and a for a in addresses):
        raise _invalid("address must be 'host:port', a gRPC target, or a list of them")
    return tuple(check_target(target) for target in addresses)


def _warn_if_lanes(lanes: int | None) -> None:
    if lanes is not None:
        warnings.warn(
            "RemoteLoader(lanes=) is ignored: batches go to whichever server is ready",
            DeprecationWarning,
            stacklevel=3,
        )


class RemoteLoader(Resumable, torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Batches of one dataset, preprocessed by a named pipeline on remote servers.

    ``for images, labels in loader`` yields ``batch_size`` samples at a time
    (``images, labels, ids`` with ``return_ids=True``): images as float32 normalized
    with the pipeline's mean/std (``normalize=True``) or as served (uint8 NCHW for the
    presets), labels and ids as int64. Each rank gets a disjoint share of every epoch,
    and every rank the same number of batches; an epoch's order depends only on
    ``(seed, epoch)``. ``rank``/``world_size`` default to ``torch.distributed``'s (or
    ``process_group``'s) when a pass starts.

    Each ``iter()`` is a pass: it resumes a loaded state, or starts the epoch given to
    ``set_epoch``, or else the epoch after the previous pass's. ``state_dict()`` counts
    only batches handed out and loads on every rank of the same job. In ``DataLoader``
    workers, worker 0 streams the whole share (so order and ``StatefulDataLoader``'s
    state stay exact) and the others end at once.

    ``address`` is ``"host:port"``, a list of them, or ``"dns:///name:port"`` (resolved
    again every ``resolve_every`` seconds). Every server streams at once and is asked
    for the next batch whenever it delivers one (at most ``prefetch + 2`` at a time);
    batches reach the user in order whichever server carried them, and those of a
    server that fails or stalls are asked of the others. ``retry_timeout`` seconds
    without any batch, or one batch slower than ``timeout``, raise ``UnavailableError``;
    every error is a ``BatchwireError`` with a ``code``. ``token`` and ``tls_*`` (PEM
    paths or bytes) authenticate to secured servers. The settings are read-only
    (``spec``, ``options``); see the client guide for the whole contract.
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
        self._addresses = _targets(address)
        given = locals()
        try:
            # The stream every pass asks for (rank, world, epoch and cursor filled in
            # then) and how it is delivered: validated once, here, read-only from now on.
            self._spec = StreamSpec(
                **{name: given[name] for name in _SPEC_ARGUMENTS},
                rank=rank or 0,
                world_size=1 if world_size is None else world_size,
                params=dict(params or {}),
            )
            self._options = LoaderOptions(
                **{name: given[name] for name in _OPTION_ARGUMENTS},
                device=torch.device(device or "cpu"),
            )
        except (ValueError, RuntimeError) as exc:
            raise _invalid(str(exc)) from exc
        self._security = ChannelSecurity.from_options(
            token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        explicit = rank is not None or world_size is not None
        self._explicit = Rank(self._spec.rank, self._spec.world_size) if explicit else None
        self._group = process_group
        _warn_if_lanes(lanes)
        self._start_fresh()

    def _start_fresh(self) -> None:
        """What a loader holds besides its settings: nothing streamed, nothing resolved."""
        self.skipped_ids: list[int] = []
        # Image payload bytes received and copied: one copy each, by design.
        self.transfer = TransferStats()
        # The share torch.distributed gave when this loader was pickled: spawned
        # DataLoader workers have no process group of their own.
        self._inherited: Rank | None = None
        self._info: pb.DatasetInfo | None = None
        self._servers = ServerSet(self._addresses)
        self._transport = Transport(self._security, on_open=close_at_exit)
        self._ledger = Ledger()
        self._pass: StreamPass | None = None
        # load_state_dict ran in this DataLoader worker: see _begin.
        self._loaded_in_worker = False

    # -- settings (read-only: a loader's stream is fixed when it is built) ----------------

    addresses = property(lambda self: self._addresses, doc="The servers' targets, as given.")
    spec = property(
        lambda self: self._spec,
        doc="The stream this loader asks for (rank, world size, epoch and cursor aside).",
    )
    options = property(lambda self: self._options, doc="How batches are delivered.")
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

    def _describe(self) -> pb.DatasetInfo:
        """The dataset as the first server that answers describes it (cached)."""
        if self._info is None:
            self._info = describe_dataset(
                self._transport,
                self._servers,
                self._spec.dataset,
                self._spec.pipeline,
                timeout=self.timeout,
            )
        return self._info

    @property
    def num_samples(self) -> int:
        """Samples in the whole dataset (all ranks)."""
        return int(self._describe().num_samples)

    @property
    def classes(self) -> list[str]:
        """Class names by label, from the dataset's manifest."""
        return list(self._describe().classes)

    def _plan(self, share: Rank, epoch: int, start: int = 0) -> tuple[StreamSpec, Plan]:
        """The stream of ``share`` in ``epoch`` from cursor ``start``, and its plan."""
        try:
            # The version the share is planned on: a server that serves another one
            # refuses the stream (FAILED_PRECONDITION) rather than mix versions.
            spec = self._spec.replace(
                rank=share.rank,
                world_size=share.world_size,
                epoch=epoch,
                start=start,
                dataset_version=self._describe().version,
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

    # -- passes -------------------------------------------------------------------------

    def _begin(self, share: Rank, tensors: Tensors) -> StreamPass:
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
                transport=self._transport,
                tensors=tensors,
                servers=self._servers,
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
        info = next(p for p in self._describe().pipelines if p.name == self.pipeline)
        tensors = Tensors(self._options, info, self.layout, self.transfer)
        stream_pass = self._begin(self._share(), tensors)
        try:
            for index in range(stream_pass.first, stream_pass.num_batches):
                try:
                    delivery = stream_pass.take(index)
                except BatchwireError as exc:
                    if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
                        # The dataset was replaced: the next pass describes it again.
                        self._info = None
                    raise
                stream_pass.cursor = delivery.cursor
                self.skipped_ids.extend(delivery.skipped_ids)
                # Also a batch whose every sample was unreadable (empty): every rank takes
                # len(loader) steps, or DDP's collectives would wait for this one.
                yield tensors.output(delivery)
            self._end(stream_pass)
        finally:
            stream_pass.stop()

    # -- life cycle --------------------------------------------------------------------

    def close(self) -> None:
        """Stop the pass in progress (cancel its streams, join its readers) and close
        the channels. The loader can be iterated again afterwards."""
        current, self._pass = self._pass, None
        if current is not None:
            current.stop()
        self._transport.close()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """A copy without threads, channels or locks (spawned DataLoader workers,
        ``ddp_spawn``); it carries the share torch.distributed gives here."""
        state = self.__dict__.copy()
        live = distributed_rank_world(self._group)
        state["_inherited"] = Rank(*live) if live is not None else self._inherited
        state["_group"] = None  # process groups don't pickle; the share above stands in
        if self._group is not None and self._explicit is None and live is not None:
            state["_explicit"] = Rank(*live)
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
