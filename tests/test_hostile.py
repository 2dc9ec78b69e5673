"""Random and hostile requests against a real server: specific codes only, and it keeps serving."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Iterator

import grpc
import pytest
from conftest import start_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from batchwire.client import RemoteLoader
from batchwire.server import BatchwireServer
from batchwire.v1 import batchwire_pb2 as pb

# What a request may legitimately get; never UNKNOWN, INTERNAL or anything else.
ALLOWED = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
U32, U64 = 2**32 - 1, 2**64 - 1


@pytest.fixture(scope="module")
def hostile_server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    # Small limits keep the valid requests among the random ones cheap.
    server = start_server(data_dir, max_batch_size=16, max_streams=4)
    yield server
    server.stop(grace=1.0)


def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:  # type: ignore[type-arg]
    """Nine times in ten a sensible value, else a hostile one: about a fifth of the
    requests are fully valid and stream, the rest break one field or more."""
    return st.sampled_from(range(10)).flatmap(lambda k: hostile if k == 9 else valid)


hostile_names = st.one_of(
    st.sampled_from(["", "../shapes", "/etc/passwd", "shapes\x00", "SHAPES", "imagenet"]),
    st.text(max_size=40),
)
params = mostly(
    st.dictionaries(st.just("size"), st.sampled_from([16.0, 32.0]), max_size=1),
    st.dictionaries(
        st.one_of(st.sampled_from(["size", "flip", "resize", "area_min"]), st.text(max_size=10)),
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**6), 10**6).map(float)
        ),
        max_size=3,
    ),
)
requests = st.builds(
    pb.StreamBatchesRequest,
    dataset=mostly(st.just("shapes"), hostile_names),
    pipeline=mostly(st.sampled_from(["train", "val"]), hostile_names),
    batch_size=mostly(st.integers(1, 16), st.integers(0, U32)),
    seed=mostly(st.integers(0, 5), st.integers(0, U64)),
    epoch=mostly(st.integers(0, 5), st.integers(0, U64)),
    shuffle=st.one_of(st.none(), st.booleans()),
    drop_last=st.one_of(st.none(), st.booleans()),
    rank=mostly(st.just(0), st.integers(0, U32)),
    world_size=mostly(st.integers(0, 2), st.integers(0, U32)),
    start=mostly(st.integers(0, 200), st.integers(0, U64)),
    lanes=mostly(st.integers(0, 2), st.integers(0, U32)),
    lane=mostly(st.just(0), st.integers(0, U32)),
    dtype=mostly(st.integers(0, 1), st.integers(-3, 8)),
    layout=mostly(st.integers(0, 2), st.integers(-3, 5)),
    params=params,
)
# Bytes appended to a serialized request: nothing, an unknown field, or garbage.
tails = mostly(
    st.just(b""), st.one_of(st.just(b"\xf8\x06\x01"), st.binary(min_size=1, max_size=12))
)


# 500 requests, each a call: seconds on a quiet host, over 5 minutes on a loaded slow one.
@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(request=requests, tail=tails)
def test_random_requests_get_specific_codes(
    hostile_server: BatchwireServer, request: pb.StreamBatchesRequest, tail: bytes
) -> None:
    with grpc.insecure_channel(hostile_server.target) as channel:
        stream = channel.unary_stream(
            "/batchwire.v1.Batchwire/StreamBatches",
            request_serializer=None,  # raw bytes: the test sends what it likes
            response_deserializer=pb.Batch.FromString,
        )
        call = stream(request.SerializeToString() + tail, timeout=60)
        try:
            batch = next(iter(call), None)
        except grpc.RpcError as exc:
            event(exc.code().name)  # type: ignore[attr-defined]
            assert exc.code() in ALLOWED, (exc.code(), exc.details())  # type: ignore[attr-defined]
            assert exc.details()  # type: ignore[attr-defined]
            return
        finally:
            call.cancel()
    event("streamed" if batch is not None else "empty share")
    if batch is not None:
        assert 0 < len(batch.ids) <= 16
        assert all(math.isfinite(v) for v in request.params.values())


def test_the_server_still_serves_after_the_random_requests(hostile_server: BatchwireServer) -> None:
    with grpc.insecure_channel(hostile_server.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with RemoteLoader(
        hostile_server.target, dataset="shapes", batch_size=16, params={"size": 32}
    ) as loader:
        images, _ = next(iter(loader))
    assert images.shape == (16, 3, 32, 32)


def test_unparsable_bytes_and_unknown_fields_are_invalid_argument(
    hostile_server: BatchwireServer,
) -> None:
    valid = pb.StreamBatchesRequest(dataset="shapes", pipeline="val", batch_size=4)
    with grpc.insecure_channel(hostile_server.target) as channel:
        stream = channel.unary_stream(
            "/batchwire.v1.Batchwire/StreamBatches", response_deserializer=pb.Batch.FromString
        )
        for payload, words in (
            (b"\xff\xff\xff", "not a valid protobuf"),
            (valid.SerializeToString() + b"\xf8\x06\x01", "fields this server does not know"),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                next(iter(stream(payload, timeout=10)))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert words in caught.value.details()  # type: ignore[attr-defined]
