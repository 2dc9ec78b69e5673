"""What every part of the server raises: one tree, each error meaning one thing.

The servicer maps the errors a request can meet to gRPC status codes in one table; the
parts that raise them never import grpc. ``batchwire serve``, ``ingest`` and ``inspect``
print the others' messages and exit.

    BatchwireServerError
    ├── ServiceError           what a request can meet; the message is for its client
    │   ├── NotFound           unknown dataset or pipeline
    │   ├── InvalidRequest     a request field is out of range or inconsistent
    │   ├── OverCapacity       a server limit (streams, batch size) is reached
    │   ├── Draining           the server is shutting down; retry elsewhere
    │   ├── VersionMismatch    a stream expects another version of its dataset (replaced)
    │   ├── PipelineFault      a pipeline failed for a reason that is not a sample (out of
    │   │                      memory, CUDA, a build, a batch that fails whole); retry
    │   │                      elsewhere
    │   └── ConnectionLost     a stream's bulk connection broke; the client resumes
    ├── DatasetError           a dataset or the data directory is missing, unreadable or
    │                          not in batchwire's format (DATA_LOSS to a client; ``inspect``
    │                          and ``serve`` say it and exit)
    ├── ConfigError            a setting, flag or config file is invalid (ValueError)
    ├── ParamError             a pipeline's parameter is unknown or out of range, in a
    │                          config or a request (ValueError)
    ├── DeviceError            the device asked for cannot be used on this host (ValueError)
    ├── IngestError            an ingest cannot proceed, for a reason the user can fix
    │   ├── LmdbSourceError    an LMDB cannot be ingested as a whole (also ValueError)
    │   └── UnsafePickle       a pickle that is not plain data (also ValueError)
    └── ServerError            a server or a unit could not start, or is not running;
        │                      never a request's (RuntimeError)
        └── MetricsError       the metrics endpoint could not be opened (also OSError)

``DatasetError`` is also :mod:`batchwire.server.data`'s, which exports it for scripts.
"""

from __future__ import annotations

__all__ = [
    "FAULT_KINDS",
    "BatchwireServerError",
    "ConfigError",
    "ConnectionLost",
    "DatasetError",
    "DeviceError",
    "Draining",
    "IngestError",
    "InvalidRequest",
    "LmdbSourceError",
    "MetricsError",
    "NotFound",
    "OverCapacity",
    "ParamError",
    "PipelineFault",
    "ServerError",
    "ServiceError",
    "UnsafePickle",
    "VersionMismatch",
]

# What failed, for PipelineFault.kind (and the metrics label), with its words for a user.
FAULT_KINDS = {
    "out_of_memory": "out of memory",
    "cuda": "CUDA error",
    "build": "the pipeline cannot be built",
    "batch": "a batch failed whose samples run apart",
    "retry": "a batch failed again without its bad samples",
    "control": "a sample that ran before fails too",
}


class BatchwireServerError(Exception):
    """The root of every error the server's parts raise; the message says what to do."""


class ServiceError(BatchwireServerError):
    """Base of the errors a request can meet; the message is for the user."""


class NotFound(ServiceError):
    pass


class InvalidRequest(ServiceError):
    pass


class OverCapacity(ServiceError):
    pass


class Draining(ServiceError):
    pass


class VersionMismatch(ServiceError):
    """The request expects a version of its dataset that this server no longer (or does
    not yet) serve: resuming would mix samples of two versions."""


class PipelineFault(ServiceError):
    """A pipeline failed for a reason that is not one of its samples: the batches it held
    are lost on this server, and the stream resumes on another one.

    ``kind`` is one of :data:`FAULT_KINDS`; the message names the pipeline, the kind and
    the cause (the gist of DALI's error).
    """

    def __init__(self, pipeline: str, kind: str, cause: str) -> None:
        super().__init__(
            f"the server's pipeline {pipeline!r} failed ({FAULT_KINDS[kind]}: {cause}); "
            "the stream resumes on another server (RemoteLoader does so from its cursor)"
        )
        self.pipeline = pipeline
        self.kind = kind
        self.cause = cause

    def __reduce__(self) -> tuple[type[PipelineFault], tuple[str, str, str]]:
        return type(self), (self.pipeline, self.kind, self.cause)


class DatasetError(BatchwireServerError):
    """A dataset directory is missing, unreadable or not in batchwire's format."""


class ConfigError(BatchwireServerError, ValueError):
    """The configuration is invalid; the message names the key and what to do."""


class ParamError(BatchwireServerError, ValueError):
    """A pipeline parameter (from config or a request) is unknown or out of range."""


class DeviceError(BatchwireServerError, ValueError):
    """The requested device cannot be used on this host."""


class IngestError(BatchwireServerError):
    """An ingest cannot proceed; the message says what to change."""


class LmdbSourceError(IngestError, ValueError):
    """The LMDB cannot be ingested as a whole; the message says why and what to do."""


class UnsafePickle(IngestError, ValueError):
    """A pickle that is not plain data (or not a pickle); the message says what it holds."""


class ServerError(BatchwireServerError, RuntimeError):
    """The server could not start (port in use, bad data directory, ...), or is not
    running."""


class MetricsError(ServerError, OSError):
    """The metrics endpoint could not be opened (the message says what to do)."""


class ConnectionLost(ServiceError):
    """A stream's bulk connection (its images' own TCP connection) broke: the client went
    away, or its connection did; a client still there resumes from its cursor."""
