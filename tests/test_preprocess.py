"""Inference preprocessing: Preprocessor against a real server, batching, bad images, limits."""

from __future__ import annotations

import concurrent.futures
import pathlib
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from conftest import start_server
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from photos import encode, impossible_huffman_table
from test_corrupt import truncated_png

from batchwire.client import (
    AuthenticationError,
    BadImagesError,
    InvalidArgumentError,
    NotFoundError,
    Preprocessed,
    Preprocessor,
    RemoteLoader,
    ResourceExhaustedError,
)
from batchwire.server import BatchwireServer
from batchwire.server.data import Dataset
from batchwire.v1 import batchwire_pb2 as pb

SMALL = {"size": 48, "resize": 56}


@pytest.fixture(scope="module")
def records(data_dir: pathlib.Path) -> list[bytes]:
    """The encoded images of the first 12 samples of `shapes`, as stored."""
    with Dataset(data_dir / "shapes") as dataset:
        images, _ = dataset.read(list(range(12)))
    return [bytes(image) for image in images]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def batching_server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    # A long gathering window, so that concurrent requests meet in one batch.
    server = start_server(data_dir, preprocess_max_delay_ms=300, preprocess_batch_size=64)
    yield server
    server.stop(grace=1.0)


def served_val(server: BatchwireServer, count: int, **kwargs: object) -> torch.Tensor:
    with RemoteLoader(
        server.target,
        dataset="shapes",
        pipeline="val",
        batch_size=count,
        shuffle=False,
        params=SMALL,
        **kwargs,  # type: ignore[arg-type]
    ) as loader:
        images, _ = next(iter(loader))
    return images


def test_preprocessor_returns_what_val_serves_from_the_dataset(
    server: BatchwireServer, records: list[bytes]
) -> None:
    served = served_val(server, 12, normalize=False)
    with Preprocessor(server.target, pipeline="val", normalize=False, params=SMALL) as pre:
        result = pre(records)
    assert isinstance(result, Preprocessed)
    assert result.images.dtype == torch.uint8
    assert tuple(result.images.shape) == (12, 3, 48, 48)
    assert torch.equal(result.images, served)
    assert result.indices.tolist() == list(range(12))
    assert result.errors == []
    assert result.raise_for_errors() is result

    # Normalized on the client with the mean/std the server announces, as RemoteLoader does.
    normalized = served_val(server, 12)
    with Preprocessor(server.target, params=SMALL) as pre:
        images, _indices, _errors = pre(records)
    assert images.dtype == torch.float32
    torch.testing.assert_close(images, normalized)

    # Normalized on the server (float16 on the wire), NHWC.
    with Preprocessor(server.target, params=SMALL, dtype="float32", layout="NHWC") as pre:
        nhwc = pre(records).images
    torch.testing.assert_close(nhwc, normalized.permute(0, 2, 3, 1), atol=1e-4, rtol=1e-4)


def test_bad_images_get_a_reason_each_and_the_others_come_back(
    server: BatchwireServer, records: list[bytes]
) -> None:
    whole = records[3]
    batch = [
        records[0],
        np.random.default_rng(7).bytes(4096),  # random bytes
        records[1],
        b"",  # empty
        encode(np.zeros((16, 16, 3), np.uint8), "GIF"),  # a format DALI cannot decode
        records[2],
        impossible_huffman_table(whole),  # headers the screen passes: fails inside DALI
        b"\xff\xd8\xff" + np.random.default_rng(8).bytes(2000),  # garbage behind a signature
        truncated_png(),  # crashed DALI's decoder, and so the server, before the screen caught it
        whole[: len(whole) // 3],  # a JPEG cut short: the GPU's decoder would not fail on it
    ]
    with Preprocessor(server.target, normalize=False, params=SMALL) as pre:
        result = pre(batch)
        alone = pre([records[0], records[1], records[2]]).images
    assert result.indices.tolist() == [0, 2, 5]
    assert torch.equal(result.images, alone)
    reasons = {error.index: error.reason for error in result.errors}
    assert sorted(reasons) == [1, 3, 4, 6, 7, 8, 9]
    assert "truncated" in reasons[8]
    assert "truncated" in reasons[9]
    assert "not an image" in reasons[1]
    assert "empty" in reasons[3]
    assert "GIF" in reasons[4]
    assert "DALI could not decode" in reasons[6]
    with pytest.raises(BadImagesError) as caught:
        result.raise_for_errors()
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [e.index for e in caught.value.errors] == [1, 3, 4, 6, 7, 8, 9]
    assert "7 of 10 images" in str(caught.value)

    # Every image bad: an empty tensor and every reason, no exception.
    with Preprocessor(server.target) as pre:
        none = pre([b"", b"not an image at all"])
    assert none.images.numel() == 0
    assert none.indices.tolist() == []
    assert [e.index for e in none.errors] == [0, 1]


def test_concurrent_requests_share_dali_batches(
    batching_server: BatchwireServer, records: list[bytes]
) -> None:
    batcher = batching_server.engine.preprocessing
    before = batcher.batches_run
    with Preprocessor(batching_server.target, normalize=False, params=SMALL) as pre:
        alone = {i: pre([records[i]]).images for i in range(9)}
        after_alone = batcher.batches_run
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: (i, pre([records[i], records[i + 1]])), range(8)))
    assert after_alone - before == 9  # one batch per request when alone
    batches = batcher.batches_run - after_alone
    assert batches < 8, f"8 concurrent requests ran as {batches} DALI batches"
    for i, result in results:
        assert result.indices.tolist() == [0, 1]
        assert torch.equal(result.images[0], alone[i][0])
        assert torch.equal(result.images[1], alone[i + 1][0])


def test_long_lists_travel_in_several_requests_in_order(
    server: BatchwireServer, records: list[bytes]
) -> None:
    images = [records[i % 12] for i in range(150)]  # three requests of at most 64
    images[70] = b"junk"
    with Preprocessor(server.target, normalize=False, params=SMALL, max_in_flight=2) as pre:
        result = pre(images)
        reference = pre(records).images
    assert [e.index for e in result.errors] == [70]
    assert result.indices.tolist() == [i for i in range(150) if i != 70]
    for row, index in zip(result.images, result.indices.tolist(), strict=True):
        assert torch.equal(row, reference[index % 12])


def test_a_random_pipeline_is_allowed(server: BatchwireServer, records: list[bytes]) -> None:
    with Preprocessor(server.target, pipeline="train", params={"size": 32}) as pre:
        images, _indices, errors = pre(records[:4])
    assert tuple(images.shape) == (4, 3, 32, 32)
    assert not errors


def test_request_errors_are_batchwire_errors_with_a_clear_message(
    data_dir: pathlib.Path, records: list[bytes]
) -> None:
    server = start_server(
        data_dir,
        max_batch_size=16,
        max_request_bytes=256 * 1024,
        preprocess_max_queued=8,
        preprocess_max_delay_ms=500,
    )
    try:
        with (
            Preprocessor(server.target, pipeline="resnet") as pre,
            pytest.raises(NotFoundError, match="no pipeline named 'resnet'"),
        ):
            pre(records[:1])
        with (
            Preprocessor(server.target, params={"bogus": 1.0}) as pre,
            pytest.raises(InvalidArgumentError, match="no parameter 'bogus'"),
        ):
            pre(records[:1])
        with Preprocessor(server.target) as pre:
            with pytest.raises(InvalidArgumentError, match="pass the file's bytes"):
                pre(["/tmp/cat.jpg"])  # type: ignore[list-item]
            with pytest.raises(InvalidArgumentError, match="not a single one"):
                pre(records[0])  # type: ignore[arg-type]
            with pytest.raises(ResourceExhaustedError, match="max_request_bytes"):
                pre([b"\xff\xd8\xff" + bytes(300 * 1024)])  # over max_request_bytes
            # Concurrent requests while the queue is held for 0.5 s: some are refused.
            with concurrent.futures.ThreadPoolExecutor(10) as pool:
                outcomes = list(
                    pool.map(lambda _: _outcome(pre, records[:3]), range(10))  # type: ignore[arg-type]
                )
        assert "ok" in outcomes
        assert any("queue is full" in o for o in outcomes), outcomes

        with grpc.insecure_channel(server.target) as channel:
            call = channel.unary_unary("/batchwire.v1.Batchwire/Preprocess")
            with pytest.raises(grpc.RpcError) as caught:
                call(pb.PreprocessRequest(pipeline="val").SerializeToString(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert "at least one" in caught.value.details()  # type: ignore[attr-defined]
            too_many = pb.PreprocessRequest(pipeline="val", images=records[:1] * 17)
            with pytest.raises(grpc.RpcError) as caught:
                call(too_many.SerializeToString(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert "limit of 16 per request" in caught.value.details()  # type: ignore[attr-defined]
            with pytest.raises(grpc.RpcError) as caught:
                call(b"\xff\xff\xff garbage", timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    finally:
        server.stop(grace=1.0)


def _outcome(pre: Preprocessor, images: list[bytes]) -> str:
    try:
        pre(images)
    except ResourceExhaustedError as exc:
        return exc.details
    return "ok"


# -- hostile requests ----------------------------------------------------------------------

SIGNATURES = [
    b"\xff\xd8\xff",  # JPEG
    b"\x89PNG\r\n\x1a\n",
    b"BM",
    b"GIF89a",
    b"RIFF\x00\x00\x00\x00WEBP",
    b"II*\x00",
    b"",
]
garbage = st.builds(
    lambda sig, body: sig + body, st.sampled_from(SIGNATURES), st.binary(max_size=300)
)
hostile_requests = st.fixed_dictionaries(
    {
        "pipeline": st.sampled_from(["val", "val", "val", "train", "", "../val", "nope"]),
        "images": st.lists(st.one_of(st.integers(0, 11), garbage), max_size=20),
        "dtype": st.sampled_from([0, 0, 0, 0, 1, 4, 5, 2, 3, 9, -1]),
        "layout": st.sampled_from([0, 0, 0, 0, 1, 2, 3, -1]),
        "params": st.one_of(
            st.just({"size": 32.0}),
            st.just({"size": 32.0}),
            st.just({"size": 32.0}),
            st.dictionaries(
                st.sampled_from(["size", "resize", "flip", "bogus"]),
                st.floats(allow_nan=True, allow_infinity=True),
                max_size=2,
            ),
        ),
    }
)


@pytest.fixture(scope="module")
def hostile_server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    server = start_server(data_dir, max_batch_size=16)
    yield server
    server.stop(grace=1.0)


@pytest.mark.slow
@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(fields=hostile_requests)
def test_random_preprocess_requests_get_specific_codes(
    hostile_server: BatchwireServer, records: list[bytes], fields: dict[str, object]
) -> None:
    images = [records[i] if isinstance(i, int) else i for i in fields["images"]]  # type: ignore[attr-defined]
    request = pb.PreprocessRequest(**{**fields, "images": images})  # type: ignore[arg-type]
    with grpc.insecure_channel(hostile_server.target) as channel:
        call = channel.unary_unary(
            "/batchwire.v1.Batchwire/Preprocess",
            response_deserializer=pb.PreprocessResponse.FromString,
        )
        try:
            response = call(request.SerializeToString(), timeout=60)
        except grpc.RpcError as exc:
            event(exc.code().name)  # type: ignore[attr-defined]
            assert exc.code() in {  # type: ignore[attr-defined]
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            }, (exc.code(), exc.details())  # type: ignore[attr-defined]
            assert exc.details()  # type: ignore[attr-defined]
            return
    event("answered")
    assert len(response.indices) + len(response.errors) == len(images)
    for index in response.indices:
        assert images[index] in records  # only real images ever succeed


def test_the_server_still_preprocesses_after_the_random_requests(
    hostile_server: BatchwireServer, records: list[bytes]
) -> None:
    with Preprocessor(hostile_server.target, params=SMALL) as pre:
        result = pre(records[:4])
    assert tuple(result.images.shape) == (4, 3, 48, 48)


def test_preprocessing_needs_the_token_of_a_secured_server(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, records: list[bytes]
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# trainers\ns3cret-token\n")
    server = start_server(data_dir, token_file=tokens)
    try:
        with Preprocessor(server.target) as pre, pytest.raises(AuthenticationError):
            pre(records[:1])
        with Preprocessor(server.target, token="s3cret-token", params=SMALL) as pre:
            assert tuple(pre(records[:2]).images.shape) == (2, 3, 48, 48)
    finally:
        server.stop(grace=1.0)
