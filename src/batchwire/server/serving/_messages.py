"""The service's messages: checking and converting requests, and mapping domain errors to
status codes (a stream's batches are encoded in :mod:`._streaming`).

A request that does not parse as its message arrives as :class:`Malformed` (see
:func:`tolerant`) and is refused like any other invalid request: INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from batchwire.common.sampler import Plan
from batchwire.common.stream import StreamSpec, output_fields
from batchwire.common.stream import check_name as check_spec_name
from batchwire.common.tensors import to_proto
from batchwire.server.engine import PreprocessRequest, PreprocessResult, share_batches
from batchwire.server.errors import (
    ConnectionLost,
    DatasetError,
    Draining,
    InvalidRequest,
    NotFound,
    OverCapacity,
    PipelineFault,
    VersionMismatch,
)
from batchwire.v1 import batchwire_pb2 as pb

__all__ = [
    "MAX_LANES",
    "STATUS_CODES",
    "Lane",
    "Malformed",
    "check_message",
    "check_name",
    "lane_from_proto",
    "preprocess_request_from_proto",
    "preprocess_result_to_proto",
    "spec_from_proto",
    "status_for",
    "tolerant",
]

# Domain error -> status code: the one place where the mapping lives. UNAVAILABLE tells
# a client to go on elsewhere (RemoteLoader resumes from its cursor on another server);
# anything not listed is a bug: INTERNAL, with the server's log to say more.
STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    NotFound: grpc.StatusCode.NOT_FOUND,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    OverCapacity: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Draining: grpc.StatusCode.UNAVAILABLE,
    VersionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    PipelineFault: grpc.StatusCode.UNAVAILABLE,
    ConnectionLost: grpc.StatusCode.UNAVAILABLE,
    DatasetError: grpc.StatusCode.DATA_LOSS,
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS_CODES.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


class Malformed:
    """What a request that does not parse as its message becomes (see ``tolerant``)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def tolerant(parse: Callable[[bytes], Message]) -> Callable[[bytes], Message | Malformed]:
    """A request deserializer that turns what does not parse into ``Malformed``."""

    def deserialize(data: bytes) -> Message | Malformed:
        try:
            return parse(data)
        except DecodeError as exc:
            return Malformed(str(exc) or "cannot parse")

    return deserialize


def check_message(request: Message | Malformed) -> None:
    """A request must parse and carry only fields this server knows."""
    if isinstance(request, Malformed):
        raise InvalidRequest(f"the request is not a valid protobuf message: {request.reason}")
    unknown = sorted({field.field_number for field in UnknownFieldSet(request)})
    if unknown:
        raise InvalidRequest(
            f"the request has fields this server does not know (numbers {unknown}); "
            "the client speaks a newer protocol: upgrade the server or drop those fields"
        )


def check_name(kind: str, name: str) -> None:
    """Dataset and pipeline names are plain names: never paths, never empty."""
    try:
        check_spec_name(kind, name)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


MAX_LANES = 1024  # lanes a StreamBatches client may split a share into


@dataclasses.dataclass(frozen=True)
class Lane:
    """Which part of a share a ``StreamBatches`` call carries: batch ``k`` of the share
    travels in lane ``k % lanes``, so that a plain client can split a share over several
    calls. Lanes are the servicer's alone: the contract (``Share``, ``Plan``) and the engine
    know only the batches a stream is asked for."""

    lane: int = 0
    lanes: int = 1

    def batches(self, plan: Plan) -> Sequence[int]:
        """The lane's batches of ``plan``'s share from its cursor on, in order."""
        share = share_batches(plan)
        return share[(self.lane - share.start) % self.lanes :: self.lanes]


def lane_from_proto(request: pb.StreamBatchesRequest) -> Lane:
    """The lane a request names (unset: the whole share); out of range is InvalidRequest."""
    lanes = request.lanes or 1
    if lanes > MAX_LANES:
        raise InvalidRequest(f"lanes must be at most {MAX_LANES}, got {lanes}")
    if not 0 <= request.lane < lanes:
        raise InvalidRequest(f"lane must be in [0, lanes), got {request.lane} of {lanes}")
    return Lane(request.lane, lanes)


def spec_from_proto(request: pb.StreamBatchesRequest | Malformed) -> StreamSpec:
    """Convert a request message; anything malformed is InvalidRequest."""
    check_message(request)
    assert not isinstance(request, Malformed)
    try:
        return StreamSpec.from_proto(request)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def preprocess_request_from_proto(request: pb.PreprocessRequest | Malformed) -> PreprocessRequest:
    """Convert a Preprocess request; anything malformed is InvalidRequest."""
    check_message(request)
    assert not isinstance(request, Malformed)
    check_name("pipeline", request.pipeline)
    try:
        output = output_fields(request)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    return PreprocessRequest(pipeline=request.pipeline, images=request.images, **output)


def preprocess_result_to_proto(result: PreprocessResult) -> pb.PreprocessResponse:
    return pb.PreprocessResponse(
        images=to_proto("images", result.images, result.layout if result.indices else ""),
        indices=result.indices,
        errors=[pb.ImageError(index=f.index, reason=f.reason) for f in result.failures],
        normalized=result.normalized,
        mean=result.mean,
        std=result.std,
    )
