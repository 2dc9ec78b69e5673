"""Records read by DALI worker processes (``read_workers``, for StreamBatches streams):
the same batches as reading inline, the same skipping of bad records, and no worker left
behind a stream. (RemoteLoader pulls its batches, which always run on the server's
shared pipelines.)"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import start_server
from test_corrupt import corrupt
from test_resources import within

from batchwire.bench import process_tree
from batchwire.client._transport import CHANNEL_OPTIONS
from batchwire.common.tensors import from_proto
from batchwire.server import BatchwireServer
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc
from batchwire.v1 import datum_pb2


@pytest.fixture(scope="module")
def parallel(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    server = start_server(data_dir, read_workers=2)
    yield server
    server.stop(grace=1.0)


def stream(
    target: str, skipped: list[int] | None = None, **options: Any
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One StreamBatches stream of a whole share: (images, labels, ids) per batch."""
    request = pb.StreamBatchesRequest(dataset="shapes", drop_last=False, **options)
    batches = []
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        for batch in pb_grpc.BatchwireStub(channel).StreamBatches(request, timeout=120):
            ids = np.asarray(batch.ids, np.int64)
            batches.append((from_proto(batch.images), from_proto(batch.labels), ids))
            if skipped is not None:
                skipped += batch.skipped_ids
    return batches


def epoch(target: str, **options: Any) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return stream(target, batch_size=32, **options)


def test_workers_serve_exactly_what_inline_reading_serves(
    server: BatchwireServer, parallel: BatchwireServer
) -> None:
    for pipeline, options in (("val", {}), ("train", {"seed": 7})):
        inline = epoch(server.target, pipeline=pipeline, **options)
        workers = epoch(parallel.target, pipeline=pipeline, **options)
        assert len(workers) == len(inline) == 17  # 520 samples, batches of 32
        for (a_images, a_labels, a_ids), (b_images, b_labels, b_ids) in zip(
            inline, workers, strict=True
        ):
            np.testing.assert_array_equal(b_ids, a_ids)
            np.testing.assert_array_equal(b_labels, a_labels)
            if pipeline == "val":  # deterministic: the same pixels
                np.testing.assert_array_equal(b_images, a_images)


def test_a_batch_with_no_readable_record_continues_inline(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    copy = tmp_path / "datasets"
    shutil.copytree(data_dir, copy)
    rng = np.random.default_rng(1)
    # Every record of the second batch (no shuffle, batches of 8) rotted, and one later.
    damage = {
        i: datum_pb2.Datum(encoded=True, label=0, data=rng.bytes(900)).SerializeToString()
        for i in range(8, 16)
    }
    damage[100] = b""
    corrupt(copy / "shapes", damage)
    server = start_server(copy, read_workers=2)
    try:
        skipped: list[int] = []
        batches = stream(
            server.target, skipped, pipeline="val", batch_size=8, shuffle=False, params={"size": 32}
        )
        delivered = [int(i) for _, _, ids in batches for i in ids]
        assert delivered == [i for i in range(520) if i not in damage]
        assert sorted(skipped) == sorted(damage)
    finally:
        server.stop(grace=1.0)


def read_workers_alive() -> list[int]:
    """This process's children running DALI's spawned workers."""
    found = []
    for pid in process_tree(os.getpid())[1:]:
        try:
            command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone already
        if b"spawn_main" in command:
            found.append(pid)
    return found


def test_worker_processes_stop_with_their_stream(parallel: BatchwireServer) -> None:
    before = set(read_workers_alive())
    request = pb.StreamBatchesRequest(
        dataset="shapes", pipeline="train", batch_size=16, params={"size": 32}
    )
    channel = grpc.insecure_channel(parallel.target)
    call = pb_grpc.BatchwireStub(channel).StreamBatches(request, timeout=120)
    next(call)
    during = set(read_workers_alive()) - before
    assert len(during) == 2  # the stream's two read workers
    call.cancel()
    channel.close()
    # The server sees the cancellation, closes the stream and lets its pipeline go.
    assert within(30.0, lambda: not set(read_workers_alive()) & during)
    assert within(30.0, lambda: parallel.engine.active_streams == 0)


def test_a_read_worker_sees_no_gpu() -> None:
    # A worker unpickles its source first. Were a GPU visible to it, the record screen
    # would open a CUDA context in every worker (520 MiB each, measured on an H200).
    script = (
        "import os, pickle\n"
        "from batchwire.server.core import PlannedSource, visible_gpu_count\n"
        "pickle.loads(pickle.dumps(PlannedSource('/data/d', [], print)))\n"
        "print(repr(os.environ['CUDA_VISIBLE_DEVICES']), visible_gpu_count())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["''", "0"]
