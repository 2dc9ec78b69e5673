"""``RemoteLoader``: a PyTorch iterable over batches streamed by batchwire servers.

A thin shell: it checks its settings, opens one transport, and builds the stages that
stream and own where it stands, whose state is its own: one stream's ``Epochs``, or a
mixture's parts (``PerSource``); docs/development.md, "The client's stages".
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

from batchwire.client._at_exit import close_at_exit
from batchwire.client._delivery import LoaderOptions, TransferStats
from batchwire.client._epochs import Epochs
from batchwire.client._frameworks import refuse_accelerate_wrappers
from batchwire.client._mixture import Described, Mixture, spec_names
from batchwire.client._pass import StreamPass
from batchwire.client._per_source import PerSource
from batchwire.client._rank import Rank, Sharing
from batchwire.client._servers import ServerSet, checked_targets
from batchwire.client._settings import setting
from batchwire.client._transport import (
    ChannelSecurity,
    GrpcTransport,
    InvalidArgumentError,
    PemSource,
    Transport,
)
from batchwire.common.stream import StreamSpec

__all__ = ["LoaderOptions", "RemoteLoader"]


def _warn_if_lanes(lanes: int | None) -> None:
    if lanes is not None:
        warnings.warn(
            "RemoteLoader(lanes=) is ignored: batches go to whichever server is ready",
            DeprecationWarning,
            stacklevel=3,
        )


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
        self._addresses = checked_targets(address)
        try:
            # The stream every pass asks for (rank, world, epoch and cursor filled in
            # then) and how it is delivered: validated once, here, read-only from now on.
            self._mixture = dataset if isinstance(dataset, Mixture) else None
            self._spec = StreamSpec(
                **spec_names(dataset),
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
        security = ChannelSecurity.from_options(
            token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        explicit = rank is not None or world_size is not None
        self._sharing = Sharing(
            Rank(self._spec.rank, self._spec.world_size) if explicit else None, process_group
        )
        _warn_if_lanes(lanes)
        self._transport = transport or GrpcTransport(security, on_open=close_at_exit)
        self._stages = self._build(elastic_batch_size)

    def _build(self, elastic_batch_size: bool) -> Epochs | PerSource:
        """The stages the loader streams with: one stream (one dataset, or a mixture
        batched at random), or a mixture's parts, one a source (made now, so that their
        ledgers are shared with DataLoader workers)."""
        # Image payload bytes received and copied: one copy each, by design.
        self.transfer = TransferStats()
        mixture = self._mixture
        if mixture is not None and mixture.batching != "random":
            return PerSource.build(
                mixture,
                self._spec,
                self._options,
                addresses=self._addresses,
                transport=self._transport,
                transfer=self.transfer,
                elastic_batch_size=elastic_batch_size,
            )
        return Epochs(
            self._spec,
            self._options,
            servers=ServerSet(self._addresses),
            transport=self._transport,
            transfer=self.transfer,
            mixture=mixture,
            elastic_batch_size=elastic_batch_size,
        )

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

    dataset_name: str = setting("_spec", "name")
    """The dataset's name (a mixture's: its sources' names joined by "+")."""
    pipeline: str = setting("_spec")
    """The pipeline's name."""
    batch_size: int = setting("_spec")
    """Samples per batch."""
    shuffle: bool = setting("_spec")
    """Whether each epoch's order is shuffled."""
    drop_last: bool = setting("_spec")
    """Whether a last batch smaller than batch_size is dropped."""
    seed: int = setting("_spec")
    """The seed of every epoch's order."""
    dtype: str = setting("_spec")
    """The dtype images travel in."""
    layout: str = setting("_spec")
    """The layout images travel in."""

    @property
    def params(self) -> dict[str, float]:
        """The pipeline parameters this loader overrides (a copy)."""
        return dict(self._spec.params)

    device: torch.device = setting("_options")
    """Where batches are delivered."""
    normalize: bool = setting("_options")
    """Whether uint8 images are normalized on the device."""
    return_ids: bool = setting("_options")
    """Whether each batch carries its sample ids."""
    prefetch: int = setting("_options")
    """Batches delivered ahead of the loop."""
    timeout: float = setting("_options")
    """Seconds to wait for a batch."""
    retry_timeout: float = setting("_options")
    """Seconds of failed servers before an error."""
    resolve_every: float = setting("_options")
    """Seconds between resolutions of a dns:/// name."""
    shared_memory: bool = setting("_options")
    """Whether servers on this host may send batches through shared memory."""
    bulk: bool = setting("_options")
    """Whether servers on other hosts may send images on a bulk connection."""

    # -- dataset facts -----------------------------------------------------------------

    def _describe(self, again: bool = False) -> Described:
        """The dataset, or each of a mixture's, as the first server that answers
        describes it (cached)."""
        return self._stages.describe(again)

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

    def __len__(self) -> int:
        """Batches per epoch for this rank (equal on every rank)."""
        return self._stages.num_batches(self._sharing.resolve())

    # -- where it stands (its stages own it) ---------------------------------------------

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
        return self._stages.epoch

    def set_epoch(self, epoch: int) -> None:
        """The next pass starts ``epoch`` (at the loaded position if a loaded state is
        about to resume ``epoch``, as after ``load_state_dict``)."""
        refuse_accelerate_wrappers()
        self._stages.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: after the last batch its last pass handed out
        (prefetched ones don't count), whether that pass is running, was left
        (``break``, an exception) or stopped by ``close()``; the next epoch once that
        pass handed out its last batch; else where the next pass starts. It loads on any
        rank, also of a job of another world size (the client guide: Elastic resume)."""
        return self._stages.state_dict(self._sharing.resolve())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next pass continues from ``state``: exactly the rest of its epoch, split
        over this job's ranks from the state's global position if the world size (or,
        with ``elastic_batch_size=True``, the batch size) changed. Refuses a state of
        another dataset, seed, shuffle or drop_last, or of another version of the dataset
        than the server serves (which it asks, for a state saved mid-epoch)."""
        self._stages.load_state_dict(state)

    @property
    def skipped_ids(self) -> list[int]:
        """The ids of records the servers could not decode, left out of their batches
        since the pass that began the current epoch."""
        return self._stages.skipped_ids

    @skipped_ids.setter
    def skipped_ids(self, ids: list[int]) -> None:
        self._stages.skipped_ids = ids

    @property
    def _pass(self) -> StreamPass | None:
        """The last pass begun of a loader of one stream (None for a mixture's parts)."""
        return self._stages.current if isinstance(self._stages, Epochs) else None

    @property
    def _servers(self) -> ServerSet:
        """The servers of a loader of one stream (a mixture's parts have their own)."""
        stages = self._stages
        return stages.servers if isinstance(stages, Epochs) else stages.parts[0].servers

    # -- iteration ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        # The stages' generator itself: the loop that takes each batch runs there.
        return self._stages.iterate(self._sharing)

    # -- life cycle --------------------------------------------------------------------

    def close(self) -> None:
        """Stop the pass in progress (cancel its streams, join its readers) and close
        the channels. The loader can be iterated again afterwards. ``state_dict()`` still
        says where that pass stood, until the next pass begins."""
        self._stages.close()
        self._transport.close()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RemoteLoader({list(self.addresses)!r}, "
            f"dataset={(self._mixture or self.dataset_name)!r}, "
            f"pipeline={self.pipeline!r}, batch_size={self.batch_size})"
        )
