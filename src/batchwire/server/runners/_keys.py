"""Which pipelines serve a request: its pipeline by name and its :class:`RunnerKey`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

from batchwire.server.errors import InvalidRequest, NotFound
from batchwire.server.pipelines import OutputSpec, ParamError, PipelineSpec

__all__ = ["OutputRequest", "RunnerKey", "pipeline_named", "runner_key"]


@dataclasses.dataclass(frozen=True)
class RunnerKey:
    """A built pipeline's identity for sharing: the streams and Preprocess batches of one
    key run on the same :class:`~batchwire.server.runners._runner.Runner` (a pipeline, its
    parameters, output format, batch size and device)."""

    pipeline: str
    params: tuple[tuple[str, float], ...]
    dtype: str
    layout: str
    batch_size: int
    device: str
    device_id: int | None


class OutputRequest(Protocol):
    """What a request (a stream's or a preprocessing one) asks of its pipeline's output."""

    @property
    def params(self) -> Mapping[str, float]: ...

    @property
    def dtype(self) -> str: ...

    @property
    def layout(self) -> str: ...


def pipeline_named(pipelines: Mapping[str, PipelineSpec], name: str) -> PipelineSpec:
    """The pipeline a request names; NotFound lists those there are."""
    pipeline = pipelines.get(name)
    if pipeline is None:
        known = ", ".join(sorted(pipelines))
        raise NotFound(f"no pipeline named {name!r} (this server has: {known})")
    return pipeline


def runner_key(
    pipeline: PipelineSpec, request: OutputRequest, *, batch_size: int, device: str
) -> tuple[RunnerKey, OutputSpec]:
    """The key of the pipelines that run ``pipeline`` with ``request``'s parameters, dtype and
    layout (no device id: the caller picks one), and the request's output.

    A parameter out of its range, or an unknown dtype or layout, is InvalidRequest.
    """
    try:
        resolved = pipeline.resolve(request.params)
        output = OutputSpec(
            dtype=request.dtype, layout=request.layout, mean=pipeline.mean, std=pipeline.std
        )
    except ParamError as exc:
        raise InvalidRequest(str(exc)) from exc
    key = RunnerKey(
        pipeline=pipeline.name,
        params=tuple(sorted(resolved.items())),
        dtype=output.dtype,
        layout=output.layout,
        batch_size=batch_size,
        device=device,
        device_id=None,
    )
    return key, output
