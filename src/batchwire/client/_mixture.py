"""A mixture of datasets as a loader asks for it (:class:`Mixture`), and what a loader
plans its passes with (:class:`Described`): one dataset's description, or a mixture's,
whose sources' sizes and versions fix its counts and so its epochs' order
(:mod:`batchwire.common.mixture`)."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchwire.client._transport import InvalidArgumentError
from batchwire.common.batchings import BATCHINGS
from batchwire.common.mixture import check_length, check_weights, mixture_counts, split_ids
from batchwire.common.stream import Source, check_name
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["Described", "Mixture", "spec_names"]


class Mixture:
    """Several datasets of one server read as one, in set proportions: pass it as a
    :class:`~batchwire.client.RemoteLoader`'s ``dataset``.

    ``weights`` (``{"imagenet": 0.7, "domain": 0.3}``) are each source's proportion of
    every epoch, relative to their sum; ``length`` is the epoch's samples: ``"sum"`` (the
    sources' sizes added up), ``"first"`` (it ends as the first source would repeat a
    sample: nothing repeats), ``"all"`` (as the last source gives its last new sample:
    the smaller ones repeat), or a number. ``counts`` (``{"web": 1_000_000, "curated":
    50_000}``) give each source's samples per epoch instead: more than its size repeats
    its samples (each ``count // size`` or one more times), fewer takes a different subset
    each epoch. Each epoch holds exactly those counts, in an order that depends only on
    ``(seed, epoch)``, the sources' sizes and the counts.

    ``batching`` says how the sources share batches: ``"random"`` (every batch a random
    mix of them, through the loader's one pipeline), ``"stratified"`` (every batch holds
    each source's share of it, rounded: the sources' samples one after the other) or
    ``"per_source"`` (every batch of one source, the sources' batches in a seeded order,
    in proportion to their counts: each may have its own ``pipeline``, ``params`` and
    ``address``, given in ``per_source``, e.g. ``{"curated": {"params": {"size": 64}}}``)."""

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        *,
        counts: Mapping[str, int] | None = None,
        length: int | str = "sum",
        batching: str = "random",
        per_source: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        try:
            given = _checked(weights, counts, length)
            settings = _checked_settings(given, batching, per_source)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        # Tuples of (name, value): read-only, and a loader holding them pickles (spawned
        # DataLoader workers, ddp_spawn).
        self._weights = (
            tuple((k, float(v)) for k, v in given.items()) if weights is not None else ()
        )
        self._counts = tuple((k, int(v)) for k, v in given.items()) if counts is not None else ()
        self._length = length
        self._batching = batching
        self._per_source = settings

    @property
    def names(self) -> tuple[str, ...]:
        """The sources' datasets, in the order given (the order of their mixed ids)."""
        return tuple(name for name, _ in self._weights or self._counts)

    @property
    def weights(self) -> Mapping[str, float] | None:
        return types.MappingProxyType(dict(self._weights)) if self._weights else None

    @property
    def counts(self) -> Mapping[str, int] | None:
        return types.MappingProxyType(dict(self._counts)) if self._counts else None

    @property
    def length(self) -> int | str:
        return self._length

    @property
    def batching(self) -> str:
        return self._batching

    @property
    def shares(self) -> tuple[float, ...]:
        """Each source's weight, or count, in the mixture's order: its share of an epoch
        relative to their sum."""
        return tuple(float(value) for _, value in self._weights or self._counts)

    def settings_of(self, name: str) -> SourceSettings:
        """What source ``name``'s batches are made with where it differs from the
        loader's (per-source batching)."""
        return dict(self._per_source).get(name, SourceSettings())

    def counts_for(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """Each source's samples per epoch, its datasets being of ``sizes``
        (``ValueError`` says what cannot be: an empty dataset given samples)."""
        if self._counts:
            return mixture_counts(sizes, counts=[count for _, count in self._counts])
        return mixture_counts(
            sizes, weights=[weight for _, weight in self._weights], length=self._length
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mixture) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[Any, ...]:
        return (self._weights, self._counts, self._length, self._batching, self._per_source)

    def __repr__(self) -> str:
        if self._counts:
            text = f"Mixture(counts={dict(self._counts)!r}"
        else:
            text = f"Mixture({dict(self._weights)!r}, length={self._length!r}"
        if self._batching != "random":
            text += f", batching={self._batching!r}"
        if self._per_source:
            text += f", per_source={ {k: v.given() for k, v in self._per_source}!r}"
        return text + ")"


def spec_names(dataset: str | Mixture) -> dict[str, Any]:
    """The StreamSpec fields that name ``dataset``. A mixture given weights has no counts
    until its sources are described (each pass, :class:`Described`): its counts here are
    placeholders, so that the spec is checked as one of a mixture."""
    if not isinstance(dataset, Mixture):
        return {"dataset": dataset}
    counts = dataset.counts or {}
    return {"sources": tuple(Source(name, counts.get(name, 1)) for name in dataset.names)}


@dataclasses.dataclass(frozen=True)
class SourceSettings:
    """A source's own settings in per-source batching (None: the loader's)."""

    address: tuple[str, ...] | None = None
    pipeline: str | None = None
    params: tuple[tuple[str, float], ...] | None = None

    def given(self) -> dict[str, Any]:
        """The settings given, as a user spells them."""
        given: dict[str, Any] = {}
        if self.address is not None:
            given["address"] = list(self.address)
        if self.pipeline is not None:
            given["pipeline"] = self.pipeline
        if self.params is not None:
            given["params"] = dict(self.params)
        return given


_SETTINGS = ("address", "pipeline", "params")


def _checked_settings(
    given: Mapping[str, Any], batching: str, per_source: Mapping[str, Mapping[str, Any]] | None
) -> tuple[tuple[str, SourceSettings], ...]:
    """Each source's own settings, by name; ValueError says what is wrong."""
    if batching not in BATCHINGS:
        raise ValueError(f"batching must be one of {BATCHINGS}, got {batching!r}")
    nothing = sorted(name for name, value in given.items() if not value)
    if batching != "random" and nothing:
        raise ValueError(
            f"dataset {nothing[0]!r} is given no samples: leave it out of a mixture batched "
            f"{batching!r} (each source is streamed on its own)"
        )
    if not per_source:
        return ()
    if batching != "per_source":
        raise ValueError(
            "sources with a pipeline, params or address of their own cannot share a batch: "
            "pass batching='per_source' (each batch of one source)"
        )
    unknown = sorted(set(per_source) - set(given))
    if unknown:
        raise ValueError(
            f"per_source names {unknown[0]!r}, which is not one of the mixture's datasets "
            f"{sorted(given)}"
        )
    settings = []
    for name, values in per_source.items():
        if not isinstance(values, Mapping):
            raise ValueError(f"per_source[{name!r}] must be a mapping of {_SETTINGS}")
        extra = sorted(set(values) - set(_SETTINGS))
        if extra:
            raise ValueError(
                f"per_source[{name!r}] sets {extra[0]!r}: a source may set only {_SETTINGS}"
            )
        address = values.get("address")
        pipeline = values.get("pipeline")
        params = values.get("params")
        if pipeline is not None:
            check_name("pipeline", pipeline)
        if params is not None and not isinstance(params, Mapping):
            raise ValueError(f"per_source[{name!r}]['params'] must be a mapping of numbers")
        settings.append(
            (
                name,
                SourceSettings(
                    address=(address,) if isinstance(address, str) else _tuple_or_none(address),
                    pipeline=pipeline,
                    params=tuple(params.items()) if params is not None else None,
                ),
            )
        )
    return tuple(settings)


def _tuple_or_none(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


def _checked(
    weights: Mapping[str, float] | None, counts: Mapping[str, int] | None, length: int | str
) -> dict[str, Any]:
    """The mixture's datasets and their weights or counts; ValueError says what is wrong."""
    if (weights is None) == (counts is None):
        raise ValueError("a Mixture takes weights or counts, one of them")
    given = dict(weights if weights is not None else counts or {})
    if not given:
        raise ValueError("a Mixture needs at least one dataset")
    for name in given:
        check_name("dataset", name)
    if weights is not None:
        check_weights(list(given.values()))
        check_length(length)
    else:
        if length != "sum":
            raise ValueError("length is for weights: counts fix the epoch's length")
        bad = {k: v for k, v in given.items() if not _is_count(v)}
        if bad:
            raise ValueError(f"counts must be whole numbers >= 0, got {bad}")
        if not sum(given.values()):
            raise ValueError("the mixture's epoch has no samples: every count is 0")
    return given


def _is_count(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value >= 0)


@dataclasses.dataclass(frozen=True)
class Described:
    """What a loader plans with: the description of its dataset (``info``), or of a
    mixture's first source (its pipelines and limits are the server's) with ``sources``:
    each dataset's count per epoch and version, as planned from their sizes now."""

    info: pb.DatasetInfo
    sources: tuple[Source, ...] = ()
    sizes: tuple[int, ...] = ()
    source_classes: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @classmethod
    def mixture(cls, mixture: Mixture, infos: Sequence[pb.DatasetInfo]) -> Described:
        """A mixture's sources as ``infos`` describe them (``ValueError`` if its counts
        cannot be planned on their sizes)."""
        sizes = tuple(int(info.num_samples) for info in infos)
        counts = mixture.counts_for(sizes)
        return cls(
            info=infos[0],
            sources=tuple(
                Source(info.name, count, info.version)
                for info, count in zip(infos, counts, strict=True)
            ),
            sizes=sizes,
            source_classes={info.name: tuple(info.classes) for info in infos},
        )

    @property
    def num_samples(self) -> int:
        """Samples per epoch: the dataset's, or the mixture's counts added up."""
        if self.sources:
            return sum(source.count for source in self.sources)
        return int(self.info.num_samples)

    @property
    def version(self) -> str:
        """One dataset's version ("" for a mixture: its sources have theirs)."""
        return "" if self.sources else self.info.version

    def planned(self) -> dict[str, Any]:
        """The StreamSpec fields that pin a stream to what was described."""
        if self.sources:
            return {"sources": self.sources}
        return {"dataset_version": self.info.version}

    @property
    def classes(self) -> list[str]:
        """The dataset's classes by label; a mixture's where its sources share them (every
        label means the same class whatever its source)."""
        if not self.sources:
            return list(self.info.classes)
        distinct = set(self.source_classes.values())
        if len(distinct) > 1:
            raise ValueError(
                "the mixture's sources have different classes, and each sample's label is "
                "in its own source's classes: read loader.source_classes[dataset], and "
                "loader.split_ids(ids) for each sample's source"
            )
        return list(next(iter(distinct)))

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, id within that source's dataset) of each of ``ids``."""
        if not self.sources:
            ids = np.asarray(ids, dtype=np.int64)
            return np.zeros(len(ids), dtype=np.int64), ids
        return split_ids(ids, self.sizes)
