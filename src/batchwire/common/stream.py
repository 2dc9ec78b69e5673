"""What a stream asks for: one frozen, validated ``StreamSpec``, and its wire form.

Every stream parameter is declared here once. The client builds a ``StreamSpec`` and
sends ``spec.to_proto()``; the server reads ``StreamSpec.from_proto(message)``; both
cut the share with ``spec.plan(num_samples)``. An invalid value is a ``ValueError``
that names the field, on whichever side it is found first.

The output formats (``OUTPUT_DTYPES``, ``LAYOUTS``) and the naming rule of datasets and
pipelines (``NAME_PATTERN``) live here too, for the same reason.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from collections.abc import Mapping, Sequence
from typing import Any

from batchwire.common.mixture import MixturePlan, mixture_counts
from batchwire.common.sampler import Plan, Share
from batchwire.v1 import batchwire_pb2 as pb

__all__ = [
    "LAYOUTS",
    "LIMITS",
    "MAX_MIXTURE_EPOCH",
    "MAX_SOURCES",
    "NAME_PATTERN",
    "OUTPUT_DTYPES",
    "Source",
    "StreamSpec",
    "check_name",
    "output_fields",
    "output_format",
]

# Names of datasets and pipelines (also directory names on the server).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# A dataset's version as DescribeDataset tells it (empty: not checked).
_VERSION_PATTERN = re.compile(r"^[0-9a-f]{0,64}$")

# The dtypes and layouts images travel in, by name and wire value; a request that
# leaves them unset gets the first of each.
OUTPUT_DTYPES: Mapping[str, pb.DType] = types.MappingProxyType(
    {"uint8": pb.UINT8, "float16": pb.FLOAT16, "float32": pb.FLOAT32}
)
LAYOUTS: Mapping[str, pb.Layout] = types.MappingProxyType({"NCHW": pb.NCHW, "NHWC": pb.NHWC})
# By wire value: any int a message may hold, known or not.
_DTYPE_NAMES: dict[int, str] = {
    **{wire: name for name, wire in OUTPUT_DTYPES.items()},
    pb.DTYPE_UNSPECIFIED: "uint8",
}
_LAYOUT_NAMES: dict[int, str] = {
    **{wire: name for name, wire in LAYOUTS.items()},
    pb.LAYOUT_UNSPECIFIED: "NCHW",
}

# Bounds beyond the contract's own checks (Plan), so that nothing huge is allocated for a
# hostile request.
LIMITS: Mapping[str, int] = types.MappingProxyType(
    {"world_size": 1 << 16, "seed": (1 << 63) - 1, "epoch": 1 << 40}
)
# A mixture's sources, and the samples of its epoch (each an int64 of its order).
MAX_SOURCES = 256
MAX_MIXTURE_EPOCH = 1 << 31


def check_name(kind: str, name: str) -> None:
    """``ValueError`` unless ``name`` is a valid dataset or pipeline name."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} must be named")
    if not NAME_PATTERN.match(name):
        raise ValueError(
            f"{kind} {name[:80]!r} is not a valid name: use letters, digits, '.', '_' or '-'"
        )


def output_format(dtype: int, layout: int) -> tuple[str, str]:
    """The names of a message's ``dtype`` and ``layout`` enums (unset: uint8, NCHW)."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} is not an output dtype (UINT8, FLOAT16, FLOAT32)")
    if layout not in _LAYOUT_NAMES:
        raise ValueError(f"layout {layout} is not NCHW or NHWC")
    return _DTYPE_NAMES[dtype], _LAYOUT_NAMES[layout]


def output_fields(message: pb.StreamBatchesRequest | pb.PreprocessRequest) -> dict[str, Any]:
    """What a request message asks of the images, by field name: ``dtype`` and ``layout``
    (:func:`output_format`) and the pipeline's ``params``; ``ValueError`` if unknown."""
    dtype, layout = output_format(message.dtype, message.layout)
    return {"dtype": dtype, "layout": layout, "params": dict(message.params)}


@dataclasses.dataclass(frozen=True)
class Source:
    """One dataset of a mixture: ``count`` samples of it each epoch (more than its size
    repeats samples, fewer takes a subset), planned on its ``version`` ("": not checked)."""

    dataset: str
    count: int
    version: str = ""

    def __post_init__(self) -> None:
        check_name("dataset", self.dataset)
        if not isinstance(self.count, int) or not 0 <= self.count <= MAX_MIXTURE_EPOCH:
            raise ValueError(
                f"source {self.dataset!r}: count must be a whole number in "
                f"[0, {MAX_MIXTURE_EPOCH}], got {self.count!r}"
            )
        _check_version(self.version)


def _check_version(version: str) -> None:
    if not _VERSION_PATTERN.match(version):
        raise ValueError(
            f"dataset_version must be hex digits (DatasetInfo.version), got {version[:80]!r}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamSpec(Share):
    """A share of a dataset (:class:`~batchwire.common.sampler.Share`: batch size, seed,
    epoch, rank, cursor, ...) through a named pipeline, in an output format.

    ``params`` override the pipeline's declared parameters (e.g. ``{"size": 160}``);
    ``dtype``/``layout`` are the images' output format. ``dataset_version``, when set, is
    the version of the dataset the share was planned on: a server serving another version
    refuses the stream.

    A mixture names ``sources`` instead of a ``dataset`` (left ""): its epoch is
    :mod:`batchwire.common.mixture`'s order of their counts, its ids mixed ids.
    """

    dataset: str = ""
    pipeline: str = "train"
    dtype: str = "uint8"
    layout: str = "NCHW"
    params: Mapping[str, float] = dataclasses.field(default_factory=dict)
    dataset_version: str = ""
    sources: tuple[Source, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "sources", tuple(self.sources))
        if self.sources:
            self._check_sources()
        else:
            check_name("dataset", self.dataset)
        check_name("pipeline", self.pipeline)
        if self.dtype not in OUTPUT_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(OUTPUT_DTYPES)}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {self.layout!r}")
        _check_version(self.dataset_version)
        for name, limit in LIMITS.items():
            if getattr(self, name) > limit:
                raise ValueError(f"{name} must be at most {limit}, got {getattr(self, name)}")
        params = {}
        for key, value in dict(self.params).items():
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"params[{key!r}] must be a finite number, got {value!r}")
            params[str(key)] = float(value)
        object.__setattr__(self, "params", params)  # a copy of its own

    def _check_sources(self) -> None:
        if self.dataset or self.dataset_version:
            raise ValueError(
                "a mixture names its datasets in sources: leave dataset and dataset_version empty"
            )
        if len(self.sources) > MAX_SOURCES:
            raise ValueError(
                f"a mixture has at most {MAX_SOURCES} sources, got {len(self.sources)}"
            )
        names = [source.dataset for source in self.sources]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(
                f"dataset {twice[0]!r} is named more than once in the mixture: give it one "
                "count (or weight)"
            )
        total = sum(source.count for source in self.sources)
        if not 0 < total <= MAX_MIXTURE_EPOCH:
            raise ValueError(
                f"a mixture's epoch must hold 1 to {MAX_MIXTURE_EPOCH} samples (its sources' "
                f"counts added up), got {total}"
            )

    @property
    def datasets(self) -> tuple[str, ...]:
        """The datasets this stream reads: its one ``dataset``, or its sources'."""
        return tuple(s.dataset for s in self.sources) if self.sources else (self.dataset,)

    @property
    def name(self) -> str:
        """The dataset's name, or a mixture's sources' names joined by "+" (for logs and
        metrics)."""
        return "+".join(self.datasets)

    def plan(self, num_samples: int | Sequence[int]) -> Plan:
        """This share of a dataset of ``num_samples``, or of a mixture of sources of
        these sizes (a :class:`~batchwire.common.mixture.MixturePlan`). ``ValueError``
        if, say, ``start`` lies past the epoch's end or a source is empty."""
        if not self.sources:
            if not isinstance(num_samples, int):
                raise TypeError("the plan of one dataset takes its size")
            return super().plan(num_samples)
        sizes = (num_samples,) if isinstance(num_samples, int) else tuple(num_samples)
        if len(sizes) != len(self.sources):
            raise ValueError(f"{len(sizes)} sizes for a mixture of {len(self.sources)} sources")
        try:
            counts = mixture_counts(sizes, counts=[source.count for source in self.sources])
        except ValueError as exc:
            raise ValueError(f"mixture of {list(self.datasets)}: {exc}") from None
        return MixturePlan(
            num_samples=sum(counts), sizes=sizes, counts=counts, **self.share_fields()
        )

    def replace(self, **changes: Any) -> StreamSpec:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)

    def to_proto(self) -> pb.StreamBatchesRequest:
        return pb.StreamBatchesRequest(
            dataset=self.dataset,
            pipeline=self.pipeline,
            dtype=OUTPUT_DTYPES[self.dtype],
            layout=LAYOUTS[self.layout],
            params=dict(self.params),
            dataset_version=self.dataset_version,
            sources=[
                pb.Source(dataset=s.dataset, count=s.count, version=s.version) for s in self.sources
            ],
            **self.share_fields(),
        )

    @classmethod
    def from_proto(cls, message: pb.StreamBatchesRequest) -> StreamSpec:
        """The spec a request message names; fields left unset take their defaults."""
        share = {f.name: getattr(message, f.name) for f in dataclasses.fields(Share)}
        # Unset optional fields are the contract's defaults, not protobuf's zeros.
        share["shuffle"] = message.shuffle if message.HasField("shuffle") else True
        share["drop_last"] = message.drop_last if message.HasField("drop_last") else True
        share["world_size"] = message.world_size or 1
        return cls(
            dataset=message.dataset,
            pipeline=message.pipeline,
            dataset_version=message.dataset_version,
            sources=tuple(Source(s.dataset, s.count, s.version) for s in message.sources),
            **output_fields(message),
            **share,
        )
