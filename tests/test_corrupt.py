"""Records that rot after ingest are skipped and reported; the epoch and the server go on."""

from __future__ import annotations

import io
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable

import grpc
import lmdb
import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE, start_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from photos import encode, impossible_huffman_table

from batchwire.client import RemoteLoader
from batchwire.server import BatchwireServer
from batchwire.server.data import Dataset, Manifest, sample_key, unsupported_reason
from batchwire.server.data.records._datum import datum_image
from batchwire.v1 import datum_pb2


def corrupt(dataset: pathlib.Path | str, damage: dict[int, bytes]) -> None:
    """Overwrite records in place, as disk rot or a bad copy would."""
    dataset = pathlib.Path(dataset)
    manifest = Manifest.load(dataset)
    for shard in manifest.shards:
        env = lmdb.open(str(dataset / shard.path), lock=False)
        with env.begin(write=True) as txn:
            for sample_id, value in damage.items():
                if shard.first_id <= sample_id < shard.first_id + shard.count:
                    txn.put(sample_key(sample_id), value)
        env.close()


def health(server: BatchwireServer) -> int:
    """The server's overall status, as the standard health service answers."""
    with grpc.insecure_channel(server.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    return int(reply.status)


def truncated_png(fraction: float = 0.1) -> bytes:
    """The head of a PNG, as a copy cut short leaves it: Pillow reads its header."""
    from PIL import Image

    pixels = np.random.default_rng(2).integers(0, 255, (90, 120, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()[: int(len(out.getvalue()) * fraction)]


def test_a_truncated_png_never_reaches_the_decoder() -> None:
    # DALI 2.4's CPU decoder crashed the process on this one (SIGSEGV), with
    # both pipelines; Pillow alone accepts its header.
    reason = unsupported_reason(truncated_png())
    assert reason is not None and "truncated" in reason


@pytest.mark.parametrize(
    ("formats", "count", "device"),
    [
        ("JPEG,PNG,BMP,TIFF,WEBP,PPM", 600, "cpu"),
        pytest.param("JPEG2000", 1500, "cpu", marks=pytest.mark.slow),  # minutes on the CPU
        pytest.param("JPEG,PNG,BMP,TIFF,WEBP,PPM", 600, "mixed", marks=pytest.mark.gpu),
        pytest.param("JPEG2000", 1500, "mixed", marks=pytest.mark.gpu),
    ],
)
def test_no_fuzzed_image_the_screen_admits_crashes_the_decoder(
    formats: str, count: int, device: str
) -> None:
    # A child process: DALI's crash (SIGSEGV) is the failure being looked for.
    script = pathlib.Path(__file__).parent / "fuzz_screen.py"
    done = subprocess.run(
        [sys.executable, str(script), "2", str(count), formats, device],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-1500:]}"
    admitted, rejected = (int(w) for w in done.stdout.splitlines()[-1].split()[1:4:2])
    assert admitted > count // 6 and rejected > count // 6  # both sides of the screen ran


def damaged(dataset: pathlib.Path, sample_id: int, damage: Callable[[bytes], bytes]) -> bytes:
    """Record ``sample_id`` with ``damage`` done to its JPEG."""
    manifest = Manifest.load(dataset)
    shard = next(s for s in manifest.shards if s.first_id <= sample_id < s.first_id + s.count)
    env = lmdb.open(str(dataset / shard.path), readonly=True, lock=False)
    with env.begin() as txn:
        datum = datum_pb2.Datum.FromString(txn.get(sample_key(sample_id)))
    env.close()
    datum.data = damage(datum.data)
    return datum.SerializeToString()


def truncated(dataset: pathlib.Path, sample_id: int) -> bytes:
    """The record with its JPEG cut to a third, as a copy that stopped leaves it."""
    return damaged(dataset, sample_id, lambda jpeg: jpeg[: len(jpeg) // 3])


def bad_huffman_table(dataset: pathlib.Path, sample_id: int) -> bytes:
    """The record with a Huffman table of its JPEG made impossible: the screen passes it,
    the decoder rejects it."""
    return damaged(dataset, sample_id, impossible_huffman_table)


JPEG_END = b"\xff\xd9"


def test_a_jpeg_cut_short_never_reaches_the_decoder() -> None:
    # nvJPEG decodes it without an error, its missing rows grey (seen on an H200), where
    # the CPU decoder fails: screened out, it is skipped on both.
    pixels = np.random.default_rng(3).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    for options in ({}, {"progressive": True}):
        whole = encode(pixels, "JPEG", **options)
        cut = whole[: len(whole) // 3]
        reason = unsupported_reason(cut)
        assert reason is not None and "truncated" in reason
        assert unsupported_reason(np.frombuffer(cut, np.uint8)) == reason
        # Its end marker back: what the screen cannot see is left to the decoder.
        assert unsupported_reason(cut + JPEG_END) is None
        # Data after the end marker (a second image, a video) is no truncation.
        assert unsupported_reason(whole + b"trailer" * 50) is None


@pytest.mark.parametrize(
    ("pipeline", "device"),
    [
        ("train", TEST_DEVICE),
        ("val", TEST_DEVICE),
        pytest.param("train", "gpu", marks=pytest.mark.gpu),
        pytest.param("val", "gpu", marks=pytest.mark.gpu),
    ],
)
def test_corrupt_records_are_skipped_reported_and_the_server_keeps_serving(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, pipeline: str, device: str
) -> None:
    copy = tmp_path / "datasets"
    shutil.copytree(data_dir, copy)
    dataset = copy / "shapes"
    rng = np.random.default_rng(0)
    damage = {
        3: truncated(dataset, 3),
        17: datum_pb2.Datum(encoded=True, label=0, data=rng.bytes(3000)).SerializeToString(),
        18: b"",  # zero length
        250: b"\x08\x96\x01 not a datum",
        519: datum_pb2.Datum(
            encoded=True, label=3, data=b"GIF89a" + rng.bytes(500)
        ).SerializeToString(),
        400: datum_pb2.Datum(encoded=True, label=1, data=truncated_png()).SerializeToString(),
    }
    corrupt(dataset, damage)
    server = start_server(copy, device=device)
    try:
        loader = RemoteLoader(
            server.target,
            dataset="shapes",
            pipeline=pipeline,
            batch_size=32,
            drop_last=False,
            return_ids=True,
            params={"size": 32},
        )
        delivered = [int(i) for _, _, ids in loader for i in ids]
        assert sorted(loader.skipped_ids) == sorted(damage)
        assert sorted(delivered) == sorted(set(range(520)) - set(damage))
        assert health(server) == health_pb2.HealthCheckResponse.SERVING
        # The next epoch is delivered the same way: the pipeline recovered.
        again = [int(i) for _, _, ids in loader for i in ids]
        assert sorted(again) == sorted(delivered)
    finally:
        server.stop(grace=1.0)


def rot_in_place(dataset: pathlib.Path, sample_id: int, at: int, data: bytes) -> None:
    """Overwrite bytes of a record's image where it lies in its shard's file, as rot does
    (nothing of LMDB's own moves)."""
    with Dataset(dataset) as opened:
        (fd, offset, length), *_ = opened.locate([sample_id]) or [(-1, 0, 0)]
        assert length, "the record is not where the shard's index says"
        record = memoryview(os.pread(fd, length, offset))
        start, _, _ = datum_image(record) or (0, 0, 0)
    with open(dataset / Manifest.load(dataset).shards[0].path / "data.mdb", "r+b") as file:
        file.seek(offset + start + at)
        file.write(data)


def test_records_that_rot_after_they_were_screened_are_screened_again(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A record is screened once per dataset version, not on every read; one whose bytes
    change after that (rot in place, or a rewrite that moves it) never reaches the decoder
    unscreened: the next epoch skips exactly the damaged ids, and the server goes on."""
    copy = tmp_path / "datasets"
    shutil.copytree(data_dir, copy)
    dataset = copy / "shapes"
    rewritten = {3: truncated(dataset, 3), 150: b"\x08\x96\x01 not a datum"}
    server = start_server(copy)
    try:
        loader = RemoteLoader(
            server.target,
            dataset="shapes",
            pipeline="val",
            batch_size=32,
            drop_last=False,
            return_ids=True,
            params={"size": 32},
        )
        first = sorted(int(i) for _, _, ids in loader for i in ids)
        assert first == list(range(520)) and not loader.skipped_ids
        rot_in_place(dataset, 5, 0, b"\0" * 64)  # its JPEG header
        rot_in_place(dataset, 77, 2, b"\xff\xc0\xff\xff")  # a bad marker segment
        # LMDB writes these elsewhere in the file; in a process of its own, as LMDB opens a
        # shard once per process and the server holds it.
        script = f"import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r}); "
        script += f"from test_corrupt import corrupt; corrupt({str(dataset)!r}, {rewritten!r})"
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
        damaged = {5, 77, *rewritten}
        second = [int(i) for _, _, ids in loader for i in ids]
        assert sorted(loader.skipped_ids) == sorted(damaged)
        assert sorted(second) == sorted(set(range(520)) - damaged)
        assert health(server) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(grace=1.0)


def batches_with_skipped_samples(server: BatchwireServer) -> float:
    return sum(
        sample.value
        for family in server.metrics.registry.collect()
        for sample in family.samples
        if sample.name == "batchwire_batches_with_skipped_samples_total"
    )


def test_a_batch_of_only_corrupt_records_is_an_empty_batch_on_every_rank(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """All ranks take len(loader) steps (DDP would hang otherwise): a batch whose every
    record is unreadable comes as an empty batch, and its ids are in skipped_ids."""
    copy = tmp_path / "datasets"
    shutil.copytree(data_dir, copy)
    dataset = copy / "shapes"
    rng = np.random.default_rng(1)
    # shuffle=False over 2 ranks: rank r's batch k of 8 holds ids 16k + r, 16k + r + 2, ...
    rank0_batch5 = list(range(80, 96, 2))  # half screened out, half failing in DALI
    rank1_batch7 = list(range(113, 128, 2))  # every one failing in DALI
    damage = {
        i: datum_pb2.Datum(encoded=True, label=0, data=rng.bytes(900)).SerializeToString()
        for i in rank0_batch5[:4]
    }
    damage |= {i: bad_huffman_table(dataset, i) for i in rank0_batch5[4:] + rank1_batch7}
    corrupt(dataset, damage)
    server = start_server(copy)
    try:
        for rank, empty_batch in ((0, 5), (1, 7)):
            loader = RemoteLoader(
                server.target,
                dataset="shapes",
                pipeline="val",
                batch_size=8,
                shuffle=False,
                drop_last=False,
                return_ids=True,
                rank=rank,
                world_size=2,
                params={"size": 32},
            )
            batches = list(loader)
            assert len(batches) == len(loader) == 33
            images, labels, ids = batches[empty_batch]
            assert images.shape == (0, 3, 32, 32) and images.dtype == torch.float32
            assert labels.shape == (0,) and ids.shape == (0,)
            assert all(len(b[2]) > 0 for k, b in enumerate(batches) if k != empty_batch)
            mine = {i for i in damage if i % 2 == rank}
            assert sorted(loader.skipped_ids) == sorted(mine)
            delivered = [int(i) for _, _, batch_ids in batches for i in batch_ids]
            assert sorted(delivered) == sorted(set(range(rank, 520, 2)) - mine)
        assert batches_with_skipped_samples(server) == 2  # one emptied on each rank
    finally:
        server.stop(grace=1.0)
