"""``RemoteLoader``: a PyTorch iterable over batches streamed by batchwire servers."""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

from batchwire.client._delivery import LoaderOptions, Tensors, TransferStats
from batchwire.client._descriptions import describe_dataset, find_workers
from batchwire.client._frameworks import refuse_accelerate_wrappers, worker_id
from batchwire.client._mixture import Described, Mixture
from batchwire.client._pass import StreamPass, close_at_exit
from batchwire.client._per_source import PerSource
from batchwire.client._rank import Rank, Sharing
from batchwire.client._servers import ServerSet
from batchwire.client._state import LoaderState, Place
from batchwire.client._transport import (
    BatchwireError,
    ChannelSecurity,
    GrpcTransport,
    InvalidArgumentError,
    PemSource,
    StatusCode,
    Transport,
    check_target,
)
from batchwire.common.mixture import source_seed, stratum_sizes
from batchwire.common.sampler import Plan
from batchwire.common.stream import Source, StreamSpec
from batchwire.common.words import counted

__all__ = ["LoaderOptions", "RemoteLoader"]

log = logging.getLogger(__name__)

# Seconds a unit and its workers get to say who they are, once a process: a worker's port
# that a firewall drops must not hold a pass for the loader's whole timeout.
_FIND_WORKERS_TIMEOUT_S = 10.0
# Servers whose credit the window makes room for twice; more share that room.
_WINDOW_SERVERS = 4


def _targets(address: str | Sequence[str]) -> tuple[str, ...]:
    addresses = (address,) if isinstance(address, str) else tuple(address)
    if not addresses or not all(isinstance(a, str) and a for a in addresses):
        raise InvalidArgumentError("address must be 'host:port', a gRPC target, or a list of them")
    return tuple(check_target(target) for target in addresses)


def _warn_if_lanes(lanes: int | None) -> None:
    if lanes is not None:
        warnings.warn(
            "RemoteLoader(lanes=) is ignored: batches go to whichever server is ready",
            DeprecationWarning,
            stacklevel=3,
        )


def _names(dataset: str | Mixture) -> dict[str, Any]:
    """The StreamSpec fields that name ``dataset``. A mixture given weights has no counts
    until its sources are described (each pass, :class:`Described`): its counts here are
    placeholders, so that the spec is checked as one of a mixture."""
    if not isinstance(dataset, Mixture):
        return {"dataset": dataset}
    counts = dataset.counts or {}
    return {"sources": tuple(Source(name, counts.get(name, 1)) for name in dataset.names)}


class _Setting:
    """A read-only attribute of a loader: field ``field`` (by default, the attribute's own
    name) of the object the loader keeps as ``holder`` (its ``_spec`` or ``_options``)."""

    def __init__(self, holder: str, field: str | None = None) -> None:
        self._holder, self._field, self._name = holder, field, field

    def __set_name__(self, owner: type, name: str) -> None:
        self._name, self._field = name, self._field or name

    def __get__(self, loader: object, owner: type | None = None) -> Any:
        if loader is None:
            return self
        return getattr(getattr(loader, self._holder), str(self._field))

    def __set__(self, loader: object, value: object) -> None:
        raise AttributeError(
            f"{type(loader).__name__}.{self._name} is read-only: a loader's settings are "
            "fixed when it is built"
        )


def _setting(holder: str, field: str | None = None) -> Any:
    """A :class:`_Setting`, typed as the attribute it is assigned to declares."""
    return _Setting(holder, field)


class RemoteLoader(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Batches of one dataset, or of a :class:`Mixture` of several, preprocessed by a
    named pipeline on remote servers.

    ``for images, labels in loader`` yields ``batch_size`` samples at a time
    (``images, labels, ids`` with ``return_ids=True``): images as float32 normalized
    with the pipeline's mean/std (``normalize=True``) or as served (uint8 NCHW for the
    presets), labels and ids as int64. Each rank gets a disjoint share of every epoch,
    and every rank the same number of batches: as in torch, an epoch's last batch may be
    short and ranks are padded to as many samples (``DistributedSampler``'s wrap-around),
    unless ``drop_last=True`` leaves the tail out (the default of a stratified mixture,
    whose batches are all full). An epoch's order depends only on ``(seed, epoch)``. ``rank``/``world_size`` default to ``torch.distributed``'s (or
    ``process_group``'s) when a pass starts.

    Each ``iter()`` is a pass: it resumes a loaded state, or starts the epoch given to
    ``set_epoch``, or else the epoch after the previous pass's. ``state_dict()`` counts
    only batches handed out and loads on every rank of the same job, or of the job
    restarted on another world size (``elastic_batch_size=True``: and another batch
    size), at the same global position in the epoch. In ``DataLoader``
    workers, worker 0 streams the whole share (so order and ``StatefulDataLoader``'s
    state stay exact) and the others end at once.

    ``address`` is ``"host:port"``, a list of them, or ``"dns:///name:port"`` (resolved
    again every ``resolve_every`` seconds). Every server streams at once and is asked
    for the next batch whenever it delivers one (at most ``prefetch + 2`` at a time);
    batches reach the user in order whichever server carried them, and those of a
    server that fails or stalls are asked of the others. ``retry_timeout`` seconds
    without any batch, or one batch slower than ``timeout``, raise ``UnavailableError``;
    every error is a ``BatchwireError`` with a ``code``. A server on this host sends the
    images through shared memory (a sealed memfd it hands to this process alone)
    rather than the socket, unless ``shared_memory=False``; a server on another host sends
    them on a TCP connection of their own beside the call (read straight into the tensor),
    unless ``bulk=False`` or the server's bulk port cannot be reached. ``token`` and ``tls_*`` (PEM
    paths or bytes) authenticate to secured servers. ``transport`` replaces the gRPC
    calls (``batchwire.client.testing.MockTransport``: a test without a server). The
    settings are read-only (``spec``, ``options``); see the client guide for the whole
    contract.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        dataset: str | Mixture,
        pipeline: str = "train",
        batch_size: int = 256,
        shuffle: bool = True,
        drop_last: bool | None = None,
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
        shared_memory: bool = True,
        bulk: bool = True,
        token: str | None = None,
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
        process_group: Any = None,
        elastic_batch_size: bool = False,
        transport: Transport | None = None,
    ) -> None:
        super().__init__()
        if drop_last is None:
            # torch's default: every sample of an epoch, the last batch short; but the
            # batches of a stratified mixture are all full, each holding every share.
            drop_last = isinstance(dataset, Mixture) and dataset.batching == "stratified"
        given = {k: v for k, v in locals().items() if k not in ("self", "__class__", "lanes")}
        self._addresses = _targets(address)
        try:
            # The stream every pass asks for (rank, world, epoch and cursor filled in
            # then) and how it is delivered: validated once, here, read-only from now on.
            self._mixture = dataset if isinstance(dataset, Mixture) else None
            self._spec = StreamSpec(
                **_names(dataset),
                pipeline=pipeline,
                batch_size=batch_size,
                seed=seed,
                shuffle=shuffle,
                drop_last=drop_last,
                dtype=dtype,
                layout=layout,
                rank=rank or 0,
                world_size=1 if world_size is None else world_size,
                params=dict(params or {}),
            )
            self._options = LoaderOptions(
                device=torch.device(device or "cpu"),
                normalize=normalize,
                return_ids=return_ids,
                prefetch=prefetch,
                timeout=timeout,
                retry_timeout=retry_timeout,
                resolve_every=resolve_every,
                shared_memory=shared_memory,
                bulk=bulk,
            )
        except (ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(str(exc)) from exc
        self._security = ChannelSecurity.from_options(
            token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        explicit = rank is not None or world_size is not None
        given_rank = Rank(self._spec.rank, self._spec.world_size) if explicit else None
        self._sharing = Sharing(given_rank, process_group)
        self._elastic_batch_size = elastic_batch_size
        _warn_if_lanes(lanes)
        self._start_fresh(transport)
        # Each batch of one source, or of each source's share: a loader a source (made
        # now, so that its ledger is shared with DataLoader workers), with the source's
        # own settings and, stratified, its share of the batch.
        self._parts = None
        if self._mixture is not None and self._mixture.batching != "random":
            strata = self._strata()
            self._parts = PerSource(
                self._mixture,
                [
                    self._part(s, name, {**given, "batch_size": strata[s]})
                    for s, name in enumerate(self._mixture.names)
                ],
                seed=seed,
                shuffle=shuffle,
            )

    def _start_fresh(self, transport: Transport | None) -> None:
        """What a loader holds besides its settings: nothing streamed, nothing resolved,
        and what its calls go through (gRPC unless ``transport`` is given)."""
        self.skipped_ids: list[int] = []
        # Image payload bytes received and copied: one copy each, by design.
        self.transfer = TransferStats()
        self._info: Described | None = None
        self._servers = ServerSet(self._addresses)
        self._transport = transport or GrpcTransport(self._security, on_open=close_at_exit)
        self._state = LoaderState(
            self._spec,
            batching=self._mixture.batching if self._mixture is not None else "random",
            elastic_batch_size=self._elastic_batch_size,
        )
        # The last pass begun, running or not: where it stood is the loader's state until
        # the next one begins (LoaderState.place).
        self._pass: StreamPass | None = None
        self._ahead: StreamPass | None = None  # the pass after this one, started early
        self._ahead_finalizer: weakref.finalize[Any, Any] | None = None
        self._passes_ended = 0  # passes of this loader (in this process) run to their end
        self._said_left_out = False  # what drop_last leaves out or padding repeats was logged

    def _strata(self) -> tuple[int, ...]:
        """Each source's samples in a batch: the batch size for each batch of one source,
        or the source's share of it when stratified."""
        assert self._mixture is not None
        names = self._mixture.names
        if self._mixture.batching != "stratified":
            return (self.batch_size,) * len(names)
        if not self.drop_last:
            raise InvalidArgumentError(
                "stratified batches are all full, each holding each source's share: pass "
                "drop_last=True (the default for stratified batching), or batching='random'"
            )
        try:
            return stratum_sizes(self.batch_size, self._mixture.shares)
        except ValueError as exc:
            raise InvalidArgumentError(f"{self._mixture!r}: {exc}") from None

    def _part(self, source: int, name: str, given: dict[str, Any]) -> RemoteLoader:
        """The loader of source ``source`` of a per-source mixture (its count of samples
        an epoch set once the sources are described: see PerSource)."""
        assert self._mixture is not None
        settings = self._mixture.settings_of(name)
        part = RemoteLoader(
            **{
                **given,
                "address": settings.address or given["address"],
                "dataset": Mixture(counts={name: 1}),
                "pipeline": settings.pipeline or given["pipeline"],
                "params": {**(given["params"] or {}), **dict(settings.params or ())},
                "seed": source_seed(self._spec.seed, source),
            }
        )
        part._transport = self._transport  # one channel a server, whichever source
        return part

    def _use_count(self, count: int) -> None:
        """This loader of a per-source mixture's one source gives ``count`` samples an
        epoch (see PerSource.describe)."""
        assert self._mixture is not None
        name = self._mixture.names[0]
        if dict(self._mixture.counts or {}) != {name: count}:
            self._mixture = Mixture(counts={name: count})
            if self._info is not None:
                self._info = Described.mixture(self._mixture, [self._info.info])

    # -- settings (read-only: a loader's stream is fixed when it is built) ----------------

    @property
    def addresses(self) -> tuple[str, ...]:
        """The servers' targets, as given."""
        return self._addresses

    @property
    def spec(self) -> StreamSpec:
        """The stream this loader asks for (rank, world size, epoch and cursor aside; a
        mixture's counts and versions are those of its sources' descriptions, each pass)."""
        return self._spec

    @property
    def mixture(self) -> Mixture | None:
        """The mixture this loader reads, or None for one dataset."""
        return self._mixture

    @property
    def options(self) -> LoaderOptions:
        """How batches are delivered."""
        return self._options

    dataset_name: str = _setting("_spec", "name")
    """The dataset's name (a mixture's: its sources' names joined by "+")."""
    pipeline: str = _setting("_spec")
    """The pipeline's name."""
    batch_size: int = _setting("_spec")
    """Samples per batch."""
    shuffle: bool = _setting("_spec")
    """Whether each epoch's order is shuffled."""
    drop_last: bool = _setting("_spec")
    """Whether a last batch smaller than batch_size is dropped."""
    seed: int = _setting("_spec")
    """The seed of every epoch's order."""
    dtype: str = _setting("_spec")
    """The dtype images travel in."""
    layout: str = _setting("_spec")
    """The layout images travel in."""

    @property
    def params(self) -> dict[str, float]:
        """The pipeline parameters this loader overrides (a copy)."""
        return dict(self._spec.params)

    device: torch.device = _setting("_options")
    """Where batches are delivered."""
    normalize: bool = _setting("_options")
    """Whether uint8 images are normalized on the device."""
    return_ids: bool = _setting("_options")
    """Whether each batch carries its sample ids."""
    prefetch: int = _setting("_options")
    """Batches delivered ahead of the loop."""
    timeout: float = _setting("_options")
    """Seconds to wait for a batch."""
    retry_timeout: float = _setting("_options")
    """Seconds of failed servers before an error."""
    resolve_every: float = _setting("_options")
    """Seconds between resolutions of a dns:/// name."""
    shared_memory: bool = _setting("_options")
    """Whether servers on this host may send batches through shared memory."""
    bulk: bool = _setting("_options")
    """Whether servers on other hosts may send images on a bulk connection."""

    # -- dataset facts -----------------------------------------------------------------

    def _describe(self, again: bool = False) -> Described:
        """The dataset, or each of a mixture's, as the first server that answers
        describes it (cached)."""
        if self._parts is not None:
            return self._parts.describe(again)
        if self._info is None or again:
            if self._mixture is None:
                self._info = Described(
                    describe_dataset(
                        self._transport, self._servers, self._spec, timeout=self.timeout
                    )
                )
            else:
                infos = [
                    describe_dataset(
                        self._transport,
                        self._servers,
                        self._spec.replace(dataset=name, sources=()),
                        timeout=self.timeout,
                    )
                    for name in self._mixture.names
                ]
                try:
                    self._info = Described.mixture(self._mixture, infos)
                except ValueError as exc:
                    raise InvalidArgumentError(f"{self._mixture!r}: {exc}") from None
        return self._info

    @property
    def num_samples(self) -> int:
        """Samples in an epoch (all ranks): the dataset's, or the mixture's counts added
        up."""
        return self._describe().num_samples

    @property
    def classes(self) -> list[str]:
        """Class names by label, from the dataset's manifest; a mixture's where its
        sources share them (else InvalidArgumentError: see :attr:`source_classes`)."""
        try:
            return self._describe().classes
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None

    @property
    def source_classes(self) -> dict[str, list[str]]:
        """Each dataset's class names by label (one entry for one dataset): a mixed
        sample's label is in its source's classes."""
        described = self._describe()
        if not described.sources:
            return {self._spec.dataset: list(described.info.classes)}
        return {name: list(classes) for name, classes in described.source_classes.items()}

    @property
    def source_counts(self) -> dict[str, int]:
        """Samples each dataset gives an epoch (a mixture's, planned from their sizes)."""
        described = self._describe()
        if not described.sources:
            return {self._spec.dataset: described.num_samples}
        return {source.dataset: source.count for source in described.sources}

    def split_ids(self, ids: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, id within its dataset) of each id a batch carries (``return_ids``): a
        mixture's ids are mixed ids, source ``s``'s sample ``i`` being ``i`` plus the sizes
        of the sources before it. Sources are numbered in the mixture's order."""
        values = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        try:
            sources, local = self._describe().split(values)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        return torch.from_numpy(np.asarray(sources)), torch.from_numpy(np.asarray(local))

    def _plan(self, rank: Rank, place: Place) -> tuple[StreamSpec, Plan]:
        """The stream of ``rank`` from ``place`` (in this loader's units), and its plan."""
        return self._state.plan(rank, place, self._describe())

    def __len__(self) -> int:
        """Batches per epoch for this rank (equal on every rank)."""
        if self._parts is not None:
            return self._parts.num_batches(self._sharing.resolve())
        return self._plan(self._sharing.resolve(), Place(0))[1].num_batches

    # -- position (batchwire.client._state) ----------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank, as of now."""
        return self._sharing.resolve().rank

    @property
    def world_size(self) -> int:
        """Ranks, as of now."""
        return self._sharing.resolve().world_size

    @property
    def epoch(self) -> int:
        """The epoch the loader stands in (see :meth:`state_dict`): its last pass's,
        until that pass handed out its last batch; else the next pass's."""
        if self._parts is not None:
            return self._parts.epoch
        return self._state.place(self._pass).epoch

    def set_epoch(self, epoch: int) -> None:
        """The next pass starts ``epoch`` (at the loaded position if a loaded state is
        about to resume ``epoch``, as after ``load_state_dict``)."""
        refuse_accelerate_wrappers()
        if self._parts is not None:
            self._parts.set_epoch(epoch)
            return
        self._state.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: after the last batch its last pass handed out
        (prefetched ones don't count), whether that pass is running, was left
        (``break``, an exception) or stopped by ``close()``; the next epoch once that
        pass handed out its last batch; else where the next pass starts. It loads on any
        rank, also of a job of another world size (the client guide: Elastic resume)."""
        if self._parts is not None:
            return self._state.mixture_state(self._sharing.resolve(), self._parts.state_dicts())
        return self._state.state_dict(self._pass, self._sharing.resolve(), self._info)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next pass continues from ``state``: exactly the rest of its epoch, split
        over this job's ranks from the state's global position if the world size (or,
        with ``elastic_batch_size=True``, the batch size) changed. Refuses a state of
        another dataset, seed, shuffle or drop_last, or of another version of the dataset
        than the server serves (which it asks, for a state saved mid-epoch)."""
        if self._parts is not None:
            self._parts.load_state_dicts(self._state.parts_of(state, self._parts.names))
            self.skipped_ids = []
            return
        # The dataset's version as the server serves it now, not as it served it before.
        if self._state.load_state_dict(state, lambda: self._describe(again=True)):
            self.skipped_ids = []

    # -- passes -------------------------------------------------------------------------

    def _begin(self, rank: Rank, tensors: Tensors) -> StreamPass:
        """Stop the previous pass, claim the next one in the ledger, start its readers."""
        previous, self._pass = self._pass, None
        if previous is not None:
            previous.supersede()
        # A state that StatefulDataLoader loaded in this worker is for the pass made right
        # after it here, which uses it up only by running to its end: torchdata primes
        # the prefetch of a restored iterator before it finds the state was of a finished
        # pass and starts another, and that discarded pass must not count (LoaderState.begin).
        with self._state.ledger.update() as entry:
            place, spec, plan = self._state.upcoming(entry, rank, self._describe())
            ahead = self._take_ahead()
            if ahead is not None and ahead.spec == spec.to_proto():
                stream_pass = ahead  # started as the last pass ended: its batches are coming
                stream_pass.book.widen(self._window())
            else:
                if ahead is not None:
                    ahead.stop()
                stream_pass = self._new_pass(spec, plan, tensors, self._window())
                stream_pass.start_readers()
            self._state.begin(entry, stream_pass.id, plan)
        self._say_what_is_left_out(plan)
        if place.cursor == 0:
            self.skipped_ids = []
        self._pass = stream_pass
        return stream_pass

    def _next_plan(self, rank: Rank) -> Plan:
        """The plan of the next pass of ``rank``, as the ledger places it now."""
        return self._state.upcoming(self._state.ledger.read(), rank, self._describe())[2]

    def _skip_to(self, epoch: int) -> None:
        """The next pass starts ``epoch``: what is left of this one is dropped (a part of a
        stratified mixture whose epoch ended with another part's)."""
        self._state.set_epoch(epoch)

    def _say_what_is_left_out(self, plan: Plan) -> None:
        """Once a loader: the samples of an epoch that drop_last leaves out, or that
        padding repeats so that every rank takes as many steps (as torch's
        ``DistributedSampler`` pads), if any. A warning without shuffle (an evaluation,
        whose accuracy would be off by them); with it, as training usually runs: INFO."""
        if self._said_left_out or plan.origin:
            return
        delivered = plan.share_size * plan.world_size
        if delivered == plan.num_samples:
            return
        self._said_left_out = True
        level = logging.INFO if plan.shuffle else logging.WARNING
        ranks = counted(plan.world_size, "rank")
        if plan.drop_last:
            log.log(
                level,
                "%s: drop_last=True leaves out %s of the %s of each epoch (batches of %d "
                "over %s); pass drop_last=False to keep them (a short last batch, ranks "
                "padded to the same number of steps)",
                self.dataset_name,
                counted(plan.num_samples - delivered, "sample"),
                counted(plan.num_samples, "sample"),
                plan.batch_size,
                ranks,
            )
        else:
            log.log(
                level,
                "%s: padding %s to the same number of steps (as DistributedSampler pads) "
                "repeats %s of the %s of each epoch; return_ids=True tells them apart, and "
                "drop_last=True leaves out the epoch's rest instead",
                self.dataset_name,
                ranks,
                counted(delivered - plan.num_samples, "sample"),
                counted(plan.num_samples, "sample"),
            )

    def _window(self) -> int:
        # Twice the servers' credit: with one credit's worth of room, a server at half
        # the others' speed held up the loop (bench --fleet: 0.75 of the sum of the
        # servers' rates, 0.95 with this). Past a few servers (a unit of many workers)
        # they share that room: what a loader holds stays bounded.
        servers = min(len(self._servers.servers()), _WINDOW_SERVERS)
        return self.prefetch + 2 * (self.prefetch + 2) * servers

    def _new_pass(self, spec: StreamSpec, plan: Plan, tensors: Tensors, window: int) -> StreamPass:
        return StreamPass(
            plan=plan,
            spec=spec.to_proto(),
            transport=self._transport,
            tensors=tensors,
            servers=self._servers,
            window=window,
        )

    def _look_ahead(self, current: StreamPass, rank: Rank, tensors: Tensors) -> None:
        """Start the pass that follows ``current`` when it runs to its end (the next
        epoch, from its start), asking each server for its first ``prefetch`` batches
        only: the next ``iter()`` adopts it if it is that pass, so that a short epoch
        (a validation pass) starts without a round trip. Anything else the next pass
        turns out to be (``set_epoch`` to another epoch, a loaded state, another world
        size) stops it. Nothing of it is in the ledger until it is adopted. Only a
        loader that ran a pass to its end before looks ahead: one that runs a single
        epoch (an inference job) asks the servers for nothing more."""
        if not self._passes_ended:
            return
        try:
            spec, plan = self._plan(rank, Place(current.plan.epoch + 1))
        except BatchwireError:
            return  # the next pass raises it itself
        if plan.num_batches == 0:
            return
        ahead = self._new_pass(spec, plan, tensors, self.prefetch)
        ahead.start_readers()
        self._ahead = ahead
        # A loader dropped without close() stops it too (a finished pass's do end).
        self._ahead_finalizer = weakref.finalize(self, ahead.stop)

    def _take_ahead(self) -> StreamPass | None:
        """The pass started ahead, now the caller's to adopt or stop; None if none."""
        ahead, self._ahead = self._ahead, None
        if self._ahead_finalizer is not None:
            self._ahead_finalizer.detach()
            self._ahead_finalizer = None
        return ahead

    def _end(self, stream_pass: StreamPass) -> None:
        """A pass that ran to its end: the next one starts the following epoch."""
        self._passes_ended += 1
        self._state.end(stream_pass)

    # -- iteration ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return self._iterate()

    def _iterate(self) -> Iterator[tuple[torch.Tensor, ...]]:
        # A generator: nothing below runs until the iterator is first advanced, so
        # frameworks that call iter() and drop the result start no pass.
        refuse_accelerate_wrappers()
        if worker_id() not in (None, 0):
            return  # worker 0 streams the whole share, in order
        rank = self._sharing.resolve()
        if self._parts is not None:
            yield from self._parts.iterate(rank, self.skipped_ids)
            return
        stream_pass, tensors = self._start(rank)
        yield from self._deliver(stream_pass, rank, tensors)

    def _start(self, rank: Rank) -> tuple[StreamPass, Tensors]:
        """Begin the next pass of ``rank``: its streams start at once."""
        info = next(p for p in self._describe().info.pipelines if p.name == self.pipeline)
        tensors = Tensors(self._options, info, self.layout, self.transfer)
        # Once a process: a unit's workers in place of the unit, to pull from each.
        find_workers(
            self._transport,
            self._servers,
            self._spec.datasets[0],
            timeout=min(self.timeout, _FIND_WORKERS_TIMEOUT_S),
        )
        return self._begin(rank, tensors), tensors

    def _deliver(
        self, stream_pass: StreamPass, rank: Rank, tensors: Tensors
    ) -> Generator[tuple[torch.Tensor, ...]]:
        """The batches of ``stream_pass``, begun by :meth:`_start`; the caller stops the
        pass if it never advances this."""
        ahead: StreamPass | None = None  # the next pass, if this iterator started it
        last = False  # this pass's last batch was handed out
        try:
            for index in range(stream_pass.first, stream_pass.plan.num_batches):
                if self._ahead is None and stream_pass.book.all_asked:
                    self._look_ahead(stream_pass, rank, tensors)
                    ahead = self._ahead
                try:
                    delivery = stream_pass.take(index)
                except BatchwireError as exc:
                    if exc.code == StatusCode.FAILED_PRECONDITION:
                        # The dataset was replaced: the next pass describes it again.
                        self._info = None
                    raise
                stream_pass.cursor = delivery.cursor
                self.skipped_ids.extend(delivery.skipped_ids)
                # Also a batch whose every sample was unreadable (empty): every rank takes
                # len(loader) steps, or DDP's collectives would wait for this one.
                # Frameworks that count batches by len() (Lightning) stop asking here.
                last = index == stream_pass.plan.num_batches - 1
                yield tensors.output(delivery)
            self._end(stream_pass)
        finally:
            stream_pass.stop()
            if not last and ahead is not None and self._ahead is ahead:
                self._take_ahead()
                ahead.stop()  # left mid-pass: not the pass that follows any more

    # -- life cycle --------------------------------------------------------------------

    def close(self) -> None:
        """Stop the pass in progress (cancel its streams, join its readers) and close
        the channels. The loader can be iterated again afterwards. ``state_dict()`` still
        says where that pass stood, until the next pass begins."""
        if self._parts is not None:
            self._parts.close()
        if self._pass is not None:
            self._pass.stop()  # kept: its place is the loader's state (LoaderState.place)
        ahead = self._take_ahead()
        if ahead is not None:
            ahead.stop()
        self._transport.close()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """A copy without threads, channels or locks (spawned DataLoader workers,
        ``ddp_spawn``); it carries the share torch.distributed gives here (Sharing)."""
        state = self.__dict__.copy()
        for key in ("_servers", "transfer", "_pass", "_ahead", "_ahead_finalizer"):
            state[key] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._servers = ServerSet(self.addresses)
        self.transfer = TransferStats()

    def __repr__(self) -> str:
        return (
            f"RemoteLoader({list(self.addresses)!r}, "
            f"dataset={(self._mixture or self.dataset_name)!r}, "
            f"pipeline={self.pipeline!r}, batch_size={self.batch_size})"
        )
