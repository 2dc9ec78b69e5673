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
from collections.abc import Mapping
from typing import Any

from batchwire.common.sampler import Plan
from batchwire.v1 import batchwire_pb2 as pb

__all__ = [
    "LAYOUTS",
    "LIMITS",
    "NAME_PATTERN",
    "OUTPUT_DTYPES",
    "StreamSpec",
    "check_name",
    "output_format",
]

# Names of datasets and pipelines (also directory names on the server).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# The dtypes and layouts images travel in, by name and wire value; a request that
# leaves them unset gets the first of each.
OUTPUT_DTYPES: Mapping[str, int] = types.MappingProxyType(
    {"uint8": pb.UINT8, "float16": pb.FLOAT16, "float32": pb.FLOAT32}
)
LAYOUTS: Mapping[str, int] = types.MappingProxyType({"NCHW": pb.NCHW, "NHWC": pb.NHWC})
_DTYPE_NAMES = {wire: name for name, wire in OUTPUT_DTYPES.items()} | {
    pb.DTYPE_UNSPECIFIED: "uint8"
}
_LAYOUT_NAMES = {wire: name for name, wire in LAYOUTS.items()} | {pb.LAYOUT_UNSPECIFIED: "NCHW"}

# Bounds beyond the contract's own checks (Plan), so that nothing huge is allocated for a
# hostile request.
LIMITS: Mapping[str, int] = types.MappingProxyType(
    {"world_size": 1 << 16, "lanes": 1024, "seed": (1 << 63) - 1, "epoch": 1 << 40}
)


def check_name(kind: str, name: str) -> None:
    """``ValueError`` unless ``name`` is a valid dataset or pipeline name."""
    if not name:
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamSpec:
    """One lane of one rank's share of one epoch of a dataset, through a pipeline.

    ``params`` override the pipeline's declared parameters (e.g. ``{"size": 160}``);
    ``dtype``/``layout`` are the images' output format. ``lanes``/``lane`` serve
    ``StreamBatches`` clients that split a share over several calls; a pulled stream
    leaves them at 1 and 0.
    """

    dataset: str
    pipeline: str = "train"
    batch_size: int
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    drop_last: bool = True
    rank: int = 0
    world_size: int = 1
    start: int = 0
    lanes: int = 1
    lane: int = 0
    dtype: str = "uint8"
    layout: str = "NCHW"
    params: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name("dataset", self.dataset)
        check_name("pipeline", self.pipeline)
        checks = (
            (self.batch_size >= 1, f"batch_size must be at least 1, got {self.batch_size}"),
            (self.world_size >= 1, f"world_size must be at least 1, got {self.world_size}"),
            (
                0 <= self.rank < self.world_size,
                f"rank must be in [0, world_size), got {self.rank} of {self.world_size}",
            ),
            (
                0 <= self.lane < self.lanes,
                f"lane must be in [0, lanes), got {self.lane} of {self.lanes}",
            ),
            (self.seed >= 0 and self.epoch >= 0, "seed and epoch must be >= 0"),
            (self.start >= 0, f"start must be >= 0, got {self.start}"),
            (
                self.dtype in OUTPUT_DTYPES,
                f"dtype must be one of {sorted(OUTPUT_DTYPES)}, got {self.dtype!r}",
            ),
            (
                self.layout in LAYOUTS,
                f"layout must be one of {sorted(LAYOUTS)}, got {self.layout!r}",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for name, limit in LIMITS.items():
            if getattr(self, name) > limit:
                raise ValueError(f"{name} must be at most {limit}, got {getattr(self, name)}")
        params = {}
        for key, value in dict(self.params).items():
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"params[{key!r}] must be a finite number, got {value!r}")
            params[str(key)] = float(value)
        object.__setattr__(self, "params", params)  # a copy of its own

    def replace(self, **changes: Any) -> StreamSpec:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)

    def plan(self, num_samples: int) -> Plan:
        """This stream's share of a dataset of ``num_samples`` (``ValueError`` if, say,
        ``start`` lies past its end)."""
        return Plan(
            num_samples=num_samples,
            batch_size=self.batch_size,
            seed=self.seed,
            epoch=self.epoch,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            rank=self.rank,
            world_size=self.world_size,
            lanes=self.lanes,
            lane=self.lane,
            start=self.start,
        )

    def to_proto(self) -> pb.StreamBatchesRequest:
        return pb.StreamBatchesRequest(
            dataset=self.dataset,
            pipeline=self.pipeline,
            batch_size=self.batch_size,
            seed=self.seed,
            epoch=self.epoch,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            rank=self.rank,
            world_size=self.world_size,
            start=self.start,
            lanes=self.lanes,
            lane=self.lane,
            dtype=OUTPUT_DTYPES[self.dtype],
            layout=LAYOUTS[self.layout],
            params=dict(self.params),
        )

    @classmethod
    def from_proto(cls, message: pb.StreamBatchesRequest) -> StreamSpec:
        """The spec a request message names; fields left unset take their defaults."""
        dtype, layout = output_format(message.dtype, message.layout)
        return cls(
            dataset=message.dataset,
            pipeline=message.pipeline,
            batch_size=message.batch_size,
            seed=message.seed,
            epoch=message.epoch,
            shuffle=message.shuffle if message.HasField("shuffle") else True,
            drop_last=message.drop_last if message.HasField("drop_last") else True,
            rank=message.rank,
            world_size=message.world_size or 1,
            start=message.start,
            lanes=message.lanes or 1,
            lane=message.lane,
            dtype=dtype,
            layout=layout,
            params=dict(message.params),
        )
