"""The Batch wire format: plain protobuf for any client, one payload copy for ours."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

from batchwire.client import BatchwireError, RemoteLoader
from batchwire.client._delivery import LoaderOptions, Tensors, TransferStats, assemble
from batchwire.common.batch_codec import decode_batch, encode_batch
from batchwire.common.tensors import from_proto, to_proto
from batchwire.server import BatchwireServer
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc


# A batch of a few hundred bytes, and one of 1.8 MB: a large batch's message is filled
# with the interpreter lock released (batch_codec._filled_bytes), a small one by bytes.join.
@pytest.mark.parametrize("shape", [(5, 3, 8, 8), (5, 3, 224, 224), (12, 3, 224, 224)])
def test_encoded_batches_are_plain_protobuf_and_decode_without_copying(
    shape: tuple[int, ...],
) -> None:
    images = np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8)
    header = pb.Batch(
        index=3, ids=[1, 2, 3, 4, 5], labels=to_proto("labels", np.arange(5), "N"), cursor=40
    )
    raw = encode_batch(header, images, "NCHW")
    parsed = pb.Batch.FromString(raw)  # what any protobuf library sees
    assert np.array_equal(from_proto(parsed.images), images)
    assert list(parsed.ids) == [1, 2, 3, 4, 5] and parsed.cursor == 40
    decoded = decode_batch(raw)
    assert np.array_equal(decoded.images, images)
    assert np.shares_memory(decoded.images, np.frombuffer(raw, np.uint8)), "a view, not a copy"
    assert decoded.header.cursor == 40 and not decoded.header.HasField("images")
    assert np.array_equal(decode_batch(parsed.SerializeToString()).images, images)
    stats = TransferStats()
    delivery = assemble([decoded], stats=stats)
    assert np.array_equal(delivery.images.numpy(), images)
    assert stats.received == stats.copied == images.nbytes


def test_malformed_batches_are_errors_not_crashes() -> None:
    raw = encode_batch(pb.Batch(index=1), np.zeros((2, 3), np.uint8), "N")
    for broken in (raw[:-1], raw[:5], b"\xff" * 12):
        with pytest.raises(ValueError):
            decode_batch(broken)


def _parts(images: np.ndarray, cut: int) -> list[bytes]:
    """Batch 7 as the server sends one too large for a message: in two parts, the first
    holding ``cut`` samples."""
    parts = []
    for part, (start, end) in enumerate(((0, cut), (cut, len(images)))):
        header = pb.Batch(
            index=7,
            part=part,
            parts=2,
            ids=range(100 + start, 100 + end),
            labels=to_proto("labels", np.arange(start, end), "N"),
            cursor=40 + end,
        )
        parts.append(encode_batch(header, images[start:end], "NCHW"))
    return parts


def test_a_batch_in_parts_becomes_one_normalized_delivery_with_one_copy() -> None:
    images = np.random.default_rng(1).integers(0, 255, (5, 3, 4, 4), dtype=np.uint8)
    info = pb.PipelineInfo(name="val", mean=[10.0, 20.0, 30.0], std=[2.0, 4.0, 8.0])
    stats = TransferStats()
    options = LoaderOptions(device=torch.device("cpu"), return_ids=True)
    tensors = Tensors(options, info, "NCHW", stats)
    (delivery,) = tensors.deliveries(map(decode_batch, _parts(images, 2)))
    assert (delivery.index, delivery.cursor) == (7, 45)
    assert stats.received == stats.copied == images.nbytes  # joined in the one copy
    out, labels, ids = tensors.output(delivery)
    mean = np.array([10.0, 20.0, 30.0]).reshape(1, 3, 1, 1)
    std = np.array([2.0, 4.0, 8.0]).reshape(1, 3, 1, 1)
    assert out.dtype == torch.float32
    assert np.allclose(out.numpy(), (images - mean) / std)
    assert labels.tolist() == [0, 1, 2, 3, 4] and ids.tolist() == [100, 101, 102, 103, 104]
    plain = Tensors(LoaderOptions(device=torch.device("cpu"), normalize=False), info, "NCHW")
    raw, _ = plain.output(next(plain.deliveries(map(decode_batch, _parts(images, 3)))))
    assert raw.dtype == torch.uint8 and np.array_equal(raw.numpy(), images)


def test_parts_out_of_order_fail_the_call_with_a_clear_error() -> None:
    images = np.zeros((4, 3, 2, 2), np.uint8)
    tensors = Tensors(LoaderOptions(device=torch.device("cpu")), pb.PipelineInfo(), "NCHW")
    with pytest.raises(BatchwireError, match="part 1 arrived after 0 parts") as caught:
        list(tensors.deliveries(map(decode_batch, _parts(images, 2)[1:])))
    assert caught.value.code == grpc.StatusCode.INTERNAL


def test_large_batches_travel_in_parts_a_plain_client_can_join(server: BatchwireServer) -> None:
    # 64 x 3 x 224 x 224 uint8 is 9.6 MB: above the server's 8 MiB message size.
    request = pb.StreamBatchesRequest(
        dataset="shapes", pipeline="val", batch_size=64, shuffle=False
    )
    with grpc.insecure_channel(
        server.target, options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)]
    ) as channel:
        call = pb_grpc.BatchwireStub(channel).StreamBatches(request, timeout=60)
        first = next(call)
        parts = [first] + [next(call) for _ in range(first.parts - 1)]
        call.cancel()
    assert first.parts == 2 and first.samples == 64
    assert [p.part for p in parts] == [0, 1]
    assert parts[0].cursor == 0 and parts[1].cursor == 64, "the cursor comes with the last part"
    joined = np.concatenate([from_proto(p.images) for p in parts])
    ids = [i for p in parts for i in p.ids]
    loader = RemoteLoader(
        server.target,
        dataset="shapes",
        pipeline="val",
        batch_size=64,
        shuffle=False,
        normalize=False,
        return_ids=True,
        shared_memory=False,  # in its messages, as from another host
    )
    images, _, loader_ids = next(iter(loader))
    assert ids == loader_ids.tolist() == list(range(64))
    assert np.array_equal(joined, images.numpy())
    # Joined in the one copy of the received bytes.
    assert loader.transfer.copied == loader.transfer.received >= images.numel()
    loader.close()


_COUNT_COPIES = """
import json, sys, tracemalloc
import numpy as np
from batchwire.common.batch_codec import decode_batch, encode_batch
from batchwire.common.tensors import to_proto
from batchwire.server.runners import Runner, RunnerKey, read_job
from batchwire.server.pipelines import PRESETS, BuildContext, OutputSpec
from batchwire.server.data import Dataset
from batchwire.v1 import batchwire_pb2 as pb

spec = PRESETS["val"]
params = tuple(sorted(spec.resolve({"size": 224}).items()))
key = RunnerKey(pipeline="val", params=params, dtype="uint8", layout="NCHW", batch_size=16,
                device="cpu", device_id=None)
runner = Runner(key, spec, BuildContext(device="cpu", output=OutputSpec()), num_threads=1,
                prefetch=1)
views = []

def finish(result):
    views.append(not result.images.flags.owndata)  # DALI's buffer, not an array of ours
    header = pb.Batch(ids=result.ids.tolist(), labels=to_proto("labels", result.labels, "N"))
    return encode_batch(header, result.images, "NCHW")

with Dataset(sys.argv[1]) as dataset:
    jobs = [read_job(dataset, seq, np.arange(seq * 16, seq * 16 + 16)) for seq in range(6)]
    shapes = []
    tracemalloc.start()
    for result in runner.run(iter(jobs)):  # finished before the runner runs on, as a slot does
        message = finish(result)
        shapes.append(list(decode_batch(message).images.shape))
        del message, result
    _, peak = tracemalloc.get_traced_memory()
print(json.dumps({"peak": peak, "views": views, "shapes": shapes}))
"""


def test_the_server_copies_each_image_once_from_dalis_buffer_into_the_message(
    data_dir: pathlib.Path,
) -> None:
    """A stream's messages are built while the images are still in DALI's output buffer:
    the Python heap then holds one copy of a batch's pixels (the message), not two (an
    array copied out of DALI, then the message built from it). Measured in a process of
    its own, so that no other thread's allocations count."""
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_COPIES, str(data_dir / "shapes")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    image_bytes = 16 * 3 * 224 * 224
    assert measured["views"] == [True] * 6
    # The runner yields each message, nothing beside it.
    assert measured["shapes"] == [[16, 3, 224, 224]] * 6
    # One batch's message at a time (each dropped before the next): one copy of its
    # pixels plus small change. Copied out of DALI first, the peak is two batches' worth.
    peak = measured["peak"]
    assert image_bytes <= peak < 1.5 * image_bytes, f"peak {peak} for {image_bytes} B batches"
