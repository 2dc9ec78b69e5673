"""What the engine needs of the server's settings: :class:`EngineConfig`."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

from batchwire.server.pipelines import PipelineSpec

__all__ = ["EngineConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The engine's settings; each field is the setting of the same name, whose help
    ``batchwire.server.ServerConfig`` declares (``batchwire serve --help`` prints it)."""

    data_dir: pathlib.Path
    pipelines: Mapping[str, PipelineSpec]
    device: str
    devices: tuple[int, ...]
    num_threads: int
    decoder_host_padding_mib: int
    decoder_device_padding_mib: int
    hw_decoder_load: float
    prefetch: int
    read_ahead_reads: int
    read_ahead_mib: int
    max_batch_size: int
    max_streams: int
    max_idle_pipelines: int
    pipelines_per_device: int
    preprocess_batch_size: int
    preprocess_max_delay_ms: float
    preprocess_max_queued: int
    max_request_bytes: int

    @classmethod
    def of(cls, settings: Any) -> EngineConfig:
        """The engine's part of ``settings`` (a ServerConfig): its fields of these names."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})
