"""What every part of the server raises, each meaning one thing to a client.

The servicer maps them to gRPC status codes in one table; the parts that raise them never
import grpc.

    ServiceError
    ├── NotFound           unknown dataset or pipeline
    ├── InvalidRequest     a request field is out of range or inconsistent
    ├── OverCapacity       a server limit (streams, batch size) is reached
    ├── Draining           the server is shutting down; retry elsewhere
    ├── VersionMismatch    a stream expects another version of its dataset (replaced)
    ├── PipelineFault      a pipeline failed for a reason that is not a sample (out of
    │                      memory, CUDA, a build, a batch that fails whole); retry elsewhere
    └── ConnectionLost     a stream's bulk connection broke; the client resumes
    DatasetError           a dataset or the data directory is missing, unreadable or not
                           in batchwire's format (DATA_LOSS to a client; ``batchwire
                           inspect`` and ``serve`` say it and exit)
    ServerError            a server or a unit could not start (port in use, metrics
                           endpoint, ...) or is not running; never a request's

``DatasetError`` is also :mod:`batchwire.server.data`'s, which exports it for scripts.
"""

from __future__ import annotations

__all__ = [
    "FAULT_KINDS",
    "ConnectionLost",
    "DatasetError",
    "Draining",
    "InvalidRequest",
    "NotFound",
    "OverCapacity",
    "PipelineFault",
    "ServerError",
    "ServiceError",
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


class ServiceError(Exception):
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


class DatasetError(Exception):
    """A dataset directory is missing, unreadable or not in batchwire's format."""


class ServerError(RuntimeError):
    """The server could not start (port in use, bad data directory, ...), or is not
    running."""


class ConnectionLost(ServiceError):
    """A stream's bulk connection (its images' own TCP connection) broke: the client went
    away, or its connection did; a client still there resumes from its cursor."""
