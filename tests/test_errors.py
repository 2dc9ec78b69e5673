"""Bad requests get the right status code and a clear message; the server keeps serving."""

from __future__ import annotations

import logging
import pickle
import re
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchwire.client import (
    BadImagesError,
    BatchwireError,
    InvalidArgumentError,
    NotFoundError,
    RemoteLoader,
    StatusCode,
    UnavailableError,
)
from batchwire.client._transport import error_for
from batchwire.server import BatchwireServer
from batchwire.server.pipelines import PRESETS
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc


@pytest.fixture()
def stub(server: BatchwireServer):  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.BatchwireStub(channel)


def assert_serving(server: BatchwireServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "batchwire.v1.Batchwire"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def stream_error(stub: pb_grpc.BatchwireStub, **fields: object) -> grpc.RpcError:
    request = pb.StreamBatchesRequest(
        **{"dataset": "shapes", "pipeline": "val", "batch_size": 4, **fields}  # type: ignore[arg-type]
    )
    with pytest.raises(grpc.RpcError) as caught:
        next(iter(stub.StreamBatches(request, timeout=30)))
    return caught.value  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"dataset": "imagenet"}, grpc.StatusCode.NOT_FOUND, "no dataset named 'imagenet'"),
        (
            {"dataset": "../shapes"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "'../shapes' is not a valid name",
        ),
        ({"dataset": "/etc/passwd"}, grpc.StatusCode.INVALID_ARGUMENT, "is not a valid name"),
        ({"dataset": "shapes/../shapes"}, grpc.StatusCode.INVALID_ARGUMENT, "not a valid name"),
        ({"pipeline": "resnet"}, grpc.StatusCode.NOT_FOUND, "no pipeline named 'resnet'"),
        ({"batch_size": 0}, grpc.StatusCode.INVALID_ARGUMENT, "batch_size"),
        ({"batch_size": 100_000}, grpc.StatusCode.INVALID_ARGUMENT, "--max-batch-size"),
        ({"rank": 2, "world_size": 2}, grpc.StatusCode.INVALID_ARGUMENT, "rank"),
        ({"lane": 1}, grpc.StatusCode.INVALID_ARGUMENT, "lane"),
        ({"start": 10_000}, grpc.StatusCode.INVALID_ARGUMENT, "start"),
        ({"world_size": 1 << 30}, grpc.StatusCode.INVALID_ARGUMENT, "world_size"),
        ({"epoch": 1 << 60}, grpc.StatusCode.INVALID_ARGUMENT, "epoch"),
        ({"params": {"size": 0}}, grpc.StatusCode.INVALID_ARGUMENT, "'size' must be in"),
        ({"params": {"code": 1}}, grpc.StatusCode.INVALID_ARGUMENT, "no parameter 'code'"),
        ({"params": {"size": 300}}, grpc.StatusCode.INVALID_ARGUMENT, "crop size"),
        ({"dtype": pb.INT64}, grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
        ({"dataset": ""}, grpc.StatusCode.INVALID_ARGUMENT, "dataset must be named"),
    ],
)
def test_bad_stream_requests_get_specific_codes(
    server: BatchwireServer,
    stub: pb_grpc.BatchwireStub,
    fields: dict[str, object],
    code: grpc.StatusCode,
    words: str,
) -> None:
    error = stream_error(stub, **fields)
    assert error.code() == code
    assert words in error.details()
    assert_serving(server)


def test_describe_unknown_dataset_is_not_found(stub: pb_grpc.BatchwireStub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.DescribeDataset(pb.DescribeDatasetRequest(dataset="nope"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    listing = stub.ListDatasets(pb.ListDatasetsRequest(), timeout=10)
    assert [d.name for d in listing.datasets] == ["shapes"]
    assert {p.name for p in listing.datasets[0].pipelines} == set(PRESETS)


def test_client_raises_its_own_errors_with_codes(server: BatchwireServer) -> None:
    with pytest.raises(NotFoundError) as caught:
        list(RemoteLoader(server.target, dataset="imagenet", batch_size=4))
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    # Which server has no such dataset, as for a pipeline.
    assert f"server {server.target}: " in str(caught.value) and "imagenet" in str(caught.value)
    with pytest.raises(NotFoundError, match=f"server {server.target} has no pipeline 'resnet'"):
        len(RemoteLoader(server.target, dataset="shapes", pipeline="resnet", batch_size=4))
    with pytest.raises(InvalidArgumentError, match="'size' must be in") as bad:
        list(RemoteLoader(server.target, dataset="shapes", batch_size=4, params={"size": 0}))
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert_serving(server)


@pytest.mark.parametrize(
    ("request_fields", "words"),
    [
        ({"params": {"size": 100_000}}, "parameter 'size' must be in [8, 1024], got 100000"),
        ({"params": {"size": 31.5}}, "parameter 'size' must be a whole number, got 31.5"),
        ({"params": {"code": 1}}, "pipeline 'train' has no parameter 'code' (it has: area_max,"),
        ({"batch_size": 5000}, "batch_size 5000 exceeds this server's limit of 1024"),
    ],
)
def test_a_request_the_server_would_refuse_fails_before_any_stream(
    server: BatchwireServer,
    stub: pb_grpc.BatchwireStub,
    caplog: pytest.LogCaptureFixture,
    request_fields: dict[str, object],
    words: str,
) -> None:
    """Bad params and a batch over the server's limit fail at the loader's first question to
    the server (here len(); also classes or iter()), in the words the server uses when a
    stream asks for the same, and before any stream opens."""
    caplog.set_level(logging.INFO)
    fields = {"batch_size": 4, **request_fields}
    loader = RemoteLoader(server.target, dataset="shapes", drop_last=False, **fields)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError) as caught:
        len(loader)
    assert words in str(caught.value)
    with pytest.raises(InvalidArgumentError, match=re.escape(words)):
        list(loader)
    assert not [r for r in caplog.records if "stream start" in r.getMessage()]
    refused = stream_error(stub, pipeline="train", **fields)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in refused.details()


def test_a_users_traceback_starts_with_batchwires_public_error(server: BatchwireServer) -> None:
    """An uncaught error in a training script: its traceback names the class as users
    import it and says the server's message, with no gRPC call object printed first; the
    gRPC error stays on it for whoever needs it."""
    script = (
        "from batchwire.client import RemoteLoader\n"
        f"list(RemoteLoader({server.target!r}, dataset='imagenet', batch_size=4))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("batchwire.client.NotFoundError: NOT_FOUND: "), done.stderr
    assert "imagenet" in last
    assert "_InactiveRpcError" not in done.stderr and "_exceptions" not in done.stderr
    with pytest.raises(NotFoundError) as caught:
        list(RemoteLoader(server.target, dataset="imagenet", batch_size=4))
    assert isinstance(caught.value.rpc_error, grpc.RpcError)
    assert caught.value.rpc_error.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"prefetch": 0}, "prefetch"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "cuda"}, "CUDA"),
        ({"dataset": "../etc"}, "not a valid name"),
        ({"params": {"size": float("nan")}}, "finite"),
    ],
)
def test_bad_loader_arguments_fail_before_any_call(kwargs: dict[str, object], words: str) -> None:
    if kwargs.get("device") == "cuda" and __import__("torch").cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ValueError, match=words) as caught:
        RemoteLoader("localhost:1", **{"dataset": "shapes", **kwargs})  # type: ignore[arg-type]
    assert isinstance(caught.value, BatchwireError)


def test_dead_server_is_a_clear_unavailable_error() -> None:
    remote = RemoteLoader("localhost:1", dataset="shapes", batch_size=4, timeout=5)
    with pytest.raises(UnavailableError, match="batchwire serve") as caught:
        list(remote)
    assert caught.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_a_loaders_settings_are_read_only() -> None:
    # Changing batch_size after construction would break resume (a state names the
    # batch size it was saved with): the settings are fixed when the loader is built.
    remote = RemoteLoader("localhost:1", dataset="shapes", batch_size=4, seed=3)
    assert (remote.batch_size, remote.seed, remote.spec.batch_size) == (4, 3, 4)
    with pytest.raises(AttributeError):
        remote.batch_size = 8  # type: ignore[misc]
    with pytest.raises(AttributeError):
        remote.spec.batch_size = 8  # type: ignore[misc]
    with pytest.raises(AttributeError):
        remote.options.prefetch = 9  # type: ignore[misc]


def test_a_batch_larger_than_the_share_with_drop_last_is_an_error_not_an_empty_epoch(
    server: BatchwireServer,
) -> None:
    # shapes has 520 samples: 260 a rank over 2 ranks, so no batch of 300 with drop_last.
    remote = RemoteLoader(
        server.target, dataset="shapes", batch_size=300, drop_last=True, rank=0, world_size=2
    )
    with pytest.raises(InvalidArgumentError, match="drop_last=False"):
        list(remote)
    with pytest.raises(InvalidArgumentError, match="Lower batch_size"):
        len(remote)
    short = RemoteLoader(
        server.target, dataset="shapes", batch_size=300, rank=0, world_size=2, drop_last=False
    )
    assert [len(labels) for _, labels in short] == [260]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (NotFoundError("no dataset 'x'"), grpc.StatusCode.NOT_FOUND),
        (InvalidArgumentError("bad batch_size"), grpc.StatusCode.INVALID_ARGUMENT),
        (UnavailableError("down"), grpc.StatusCode.UNAVAILABLE),
        (UnavailableError("slow", code=grpc.StatusCode.DEADLINE_EXCEEDED), None),
        (BatchwireError("odd"), grpc.StatusCode.UNKNOWN),
        # The form of earlier releases, code first, still builds the same error.
        (NotFoundError(grpc.StatusCode.NOT_FOUND, "no dataset 'x'"), grpc.StatusCode.NOT_FOUND),
    ],
)
def test_an_errors_code_defaults_from_its_class_and_survives_pickling(
    error: BatchwireError, code: grpc.StatusCode | None
) -> None:
    # Users raise these in their own code (fakes of a loader, retry wrappers), and
    # multiprocessing queues pickle them.
    code = code or grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.code == code and str(error) == f"{code.name}: {error.details}"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert (copy.code, copy.details, str(copy)) == (error.code, error.details, str(error))


def test_the_clients_status_codes_are_grpcs_by_name_and_equal_to_them() -> None:
    """The client's own codes, which its errors carry (no grpc needed to read them), name
    and value every code gRPC has, and compare and hash as gRPC's do: code written against
    ``grpc.StatusCode`` keeps working."""
    assert [(c.name, c.value) for c in StatusCode] == [(c.name, c.value) for c in grpc.StatusCode]
    for code in grpc.StatusCode:
        ours = StatusCode.of(code)
        assert ours == code and code == ours and hash(ours) == hash(code)
        assert {code: True}.get(ours) and ours in (code,)
        assert all(ours != other for other in grpc.StatusCode if other is not code)
    raised = error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "no batch in 5 s")
    assert type(raised.code) is StatusCode and isinstance(raised, UnavailableError)


def test_bad_images_errors_keep_their_failures_through_pickling() -> None:
    error = BadImagesError("1 of 2 images could not be preprocessed", errors=((1, "truncated"),))
    copy = pickle.loads(pickle.dumps(error))
    assert copy.code == grpc.StatusCode.INVALID_ARGUMENT and copy.errors == ((1, "truncated"),)
    assert isinstance(copy, ValueError)
