"""Read-ahead: a cold epoch is the warm epoch, the bytes read ahead stay bounded, and a
closed stream's read-ahead ends."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import start_server
from test_corrupt import corrupt, truncated
from test_resources import within

from batchwire.client import RemoteLoader
from batchwire.server import BatchwireServer
from batchwire.server.data import Dataset
from batchwire.server.data.records import _dataset, _readahead
from batchwire.server.data.records._readahead import ReadAhead, StreamReadAhead
from batchwire.server.runners import Job, read_job
from batchwire.v1 import datum_pb2
from benchmarks.cold import evict

BATCH = 16


@dataclasses.dataclass
class Planned:
    """A stream of ``batches``, as its read-ahead sees it."""

    batches: list[np.ndarray]

    def batch_ids(self, seq: int) -> np.ndarray | None:
        return self.batches[seq] if 0 <= seq < len(self.batches) else None


def follow(stream: StreamReadAhead, batches: list[np.ndarray]) -> None:
    stream.follow(Planned(batches))


def read(stream: StreamReadAhead, dataset: Dataset, seq: int, ids: np.ndarray) -> Job:
    """Batch ``seq``'s job, read as a stream reads it: its read-ahead told which batch is
    read, and when it is."""
    stream.reading(seq)
    try:
        return read_job(dataset, seq, ids)
    finally:
        stream.read(seq)


def test_locate_finds_each_record_where_lmdb_keeps_it(data_dir: pathlib.Path) -> None:
    with Dataset(data_dir / "shapes") as dataset:
        images, labels = dataset.read(np.arange(dataset.num_samples))
        located = 0
        for sample_id, (image, label) in enumerate(zip(images, labels, strict=True)):
            where = dataset.locate([sample_id])
            if not where:  # a value small enough to sit in its leaf page
                continue
            ((fd, offset, length),) = where
            datum = datum_pb2.Datum.FromString(os.pread(fd, length, offset))
            assert image is not None and datum.data == image.tobytes()
            assert datum.label == label
            located += 1
        assert located > dataset.num_samples // 2


def test_read_ahead_stays_within_its_bytes_shares_them_and_ends_with_its_stream(
    data_dir: pathlib.Path,
) -> None:
    with Dataset(data_dir / "shapes") as dataset:
        batches = [np.arange(i, i + BATCH) for i in range(0, 512, BATCH)]
        largest = max(sum(span[2] for span in dataset.locate(ids)) for ids in batches)
        pool = ReadAhead(reads=4, max_bytes=3 * largest)  # room for 3 to 6 batches
        try:
            # Two streams whose clients take nothing: together they fill the bound, not
            # more, and each gets a part of it.
            first, second = pool.open(dataset), pool.open(dataset)
            with pool.lock:  # both at once, as streams already open when a thread looks
                follow(first, batches)
                follow(second, batches[::-1])
            assert within(30.0, lambda: pool.stats().held_bytes + largest > pool.max_bytes), (
                "timed out waiting for the read-ahead"
            )
            with pool.lock:
                stats = pool.stats()
                assert first.held_bytes > 0 and second.held_bytes > 0
                assert first.held_bytes + second.held_bytes == stats.held_bytes
            assert stats.held_bytes <= pool.max_bytes and stats.peak_held_bytes <= pool.max_bytes

            # Reading the first batch frees what was read ahead of it, making room for more.
            advised = first.records + second.records
            assert first.held.get(0, 0) > 0
            first.read(0)
            assert 0 not in first.held
            assert within(30.0, lambda: first.records + second.records > advised), (
                "timed out waiting for the read-ahead"
            )

            # Closing a stream frees what it held; nothing of it is read ahead after.
            first.close()
            after_close = first.records
            assert first.held_bytes == 0 and pool.stats().streams == 1
            for seq, ids in enumerate(batches[::-1]):
                assert len(read(second, dataset, seq, ids).ids) == BATCH
            second.close()
            stats = pool.stats()
            assert first.records == after_close and second.records > 0
            assert stats.streams == 0 and stats.held_bytes == 0 and stats.in_flight == 0
            assert stats.peak_held_bytes <= pool.max_bytes
        finally:
            pool.close()


def test_a_stream_reads_ahead_only_while_its_reads_wait_for_the_disk(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the page cache a stream's read-ahead advises its first batches and then stays
    idle; from a cold cache on a slow disk (each read that waits for it, 10 ms more) it
    advises the batches ahead, and the stream's reads find them in the page cache."""
    shutil.copytree(data_dir / "shapes", tmp_path / "shapes")
    batches = [np.arange(i, i + BATCH) for i in range(0, 512, BATCH)]

    def advised_over_an_epoch(dataset: Dataset) -> int:
        pool = ReadAhead(reads=2, max_bytes=64 << 20)
        try:
            stream = pool.open(dataset)
            follow(stream, batches)
            for seq, ids in enumerate(batches):
                assert len(read(stream, dataset, seq, ids).ids) == BATCH
            stream.close()
            return stream.records
        finally:
            pool.close()

    pread_rest = _dataset._pread_rest

    def slow_disk(fd: int, buffer: memoryview, offset: int) -> int:
        time.sleep(0.010)
        return pread_rest(fd, buffer, offset)

    with Dataset(tmp_path / "shapes") as dataset:
        dataset.read(np.arange(dataset.num_samples))  # every record in the page cache
        misses = dataset.misses
        warm = advised_over_an_epoch(dataset)
        assert dataset.misses == misses  # it read nothing from the disk
        os.sync()  # the copy's pages written back, so that they can be dropped
        evict(tmp_path / "shapes")
        monkeypatch.setattr(_dataset, "_pread_rest", slow_disk)
        cold = advised_over_an_epoch(dataset)
        cold_misses = dataset.misses - misses
    assert warm <= 4 * BATCH  # its first batches (_FIRST_BATCHES), then nothing
    assert cold > 8 * BATCH, (warm, cold)
    assert 0 < cold_misses < cold, (cold_misses, cold)  # most were read ahead in time


class TimedRecords:
    """Records whose reads wait for the disk as long as a test says, on the test's clock:
    where a read-ahead decides from what it sees of its stream's reads."""

    name, num_samples = "timed", 1 << 20

    def __init__(self) -> None:
        self.now = 0.0
        self.waited = 0.0

    def read_screened(
        self, ids: np.ndarray
    ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[int]]:
        raise AssertionError("not read here")

    def locate(self, ids: object) -> list[tuple[int, int, int]]:
        return []  # nothing to advise: the test follows what the stream would advise


def test_a_stream_reads_ahead_where_its_reads_wait_long_enough_to_hold_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read that waits for the disk for a small part of the stream's time between batches
    is hidden behind the pipeline's run of the batches before it: the stream then reads
    ahead only its first batches. Reads that wait for most of it are read ahead of, further
    further with each such read; a rare slow read, a few batches only."""
    records = TimedRecords()
    monkeypatch.setattr(
        _readahead,
        "time",
        SimpleNamespace(perf_counter=lambda: records.now, monotonic=time.monotonic),
    )
    pool = ReadAhead(reads=1, max_bytes=64 << 20)
    try:
        stream = pool.open(records)
        follow(stream, [np.arange(i, i + BATCH) for i in range(0, 1 << 20, BATCH)])

        def read(waits: list[float], first: int = 0) -> list[int]:
            """Read a batch each 20 ms, batch ``first + i`` waiting ``waits[i]`` s for the
            disk (as a stream's read tells it); the last batch to be read ahead
            after each."""
            ahead = []
            for seq, wait in enumerate(waits, first):
                stream.reading(seq)
                records.waited += wait
                stream.read(seq)
                records.now += 0.020
                ahead.append(stream.advise_until)
            return ahead

        fast = read([0.003] * 100)  # a fast disk: 3 ms of each 20
        assert set(fast) == {_readahead._FIRST_BATCHES - 1}  # its first batches, no more
        slow = read([0.015] * 100, first=100)  # most of each 20 ms, advised or not
        assert all(after > seq for seq, after in enumerate(slow, 100))  # always ahead
        assert slow[-1] == 199 + _readahead._MAX_HORIZON  # and as far as it reads ahead
        spike = read([0.003] * 200 + [0.040] + [0.003] * 100, first=200)
        assert spike[199] == slow[-1]  # fast again: nothing more read ahead
        # A rare slow read among fast ones: the horizon had come back down, and the
        # stream reads a few batches ahead of that one only.
        assert spike[-1] == spike[200] <= 400 + 2 * _readahead._FIRST_BATCHES
    finally:
        pool.close()


def test_a_batch_from_a_cold_cache_asks_the_disk_for_all_its_records_before_waiting(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's records not in the page cache are all advised to the kernel, then read:
    the disk has the whole batch queued, not one record at a time. The bytes are those of
    a warm read; a warm read asks the disk for nothing."""
    shutil.copytree(data_dir / "shapes", tmp_path / "shapes")
    ids = np.random.default_rng(3).permutation(512)[:64]
    calls: list[tuple[str, int]] = []
    advise, pread_rest = _dataset.advise, _dataset._pread_rest

    def advised(fd: int, offset: int, length: int) -> None:
        calls.append(("advise", offset + length))
        advise(fd, offset, length)

    def waited(fd: int, buffer: memoryview, offset: int) -> int:
        calls.append(("read", offset + len(buffer)))
        return pread_rest(fd, buffer, offset)

    monkeypatch.setattr(_dataset, "advise", advised)
    monkeypatch.setattr(_dataset, "_pread_rest", waited)
    with Dataset(tmp_path / "shapes") as dataset:
        warm_images, warm_labels = dataset.read(ids)  # the copy's pages are cached
        assert calls == [] and dataset.misses == 0  # nothing asked of the disk
        os.sync()  # written back, so that they can be dropped
        evict(tmp_path / "shapes")
        images, labels = dataset.read(ids)
        assert dataset.misses > 0
    kinds = [kind for kind, _ in calls]
    assert "read" in kinds and kinds.index("read") == kinds.count("advise"), kinds
    assert sorted(end for kind, end in calls if kind == "read") == sorted(
        end for kind, end in calls if kind == "advise"
    )  # each record waited for was advised first
    assert labels.tolist() == warm_labels.tolist()
    for image, warm in zip(images, warm_images, strict=True):
        assert image is not None and warm is not None and image.tobytes() == warm.tobytes()


def small_loader(server: BatchwireServer, **options: object) -> RemoteLoader:
    """A loader of the shapes' ids through the val pipeline at size 32."""
    return RemoteLoader(
        server.target,
        dataset="shapes",
        pipeline="val",
        batch_size=BATCH,
        return_ids=True,
        params={"size": 32, "resize": 32},
        **options,  # type: ignore[arg-type]
    )


def epoch_ids(server: BatchwireServer, world_size: int) -> list[list[int]]:
    """Every rank's ids of one shuffled epoch, the ranks streaming at once."""
    delivered: list[list[int]] = [[] for _ in range(world_size)]
    failures: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with small_loader(server, rank=r, world_size=world_size, seed=7) as loader:
                delivered[r] = [int(i) for _, _, ids in loader for i in ids]
        except BaseException as exc:  # raised in the test's thread below
            failures.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not failures, failures
    return delivered


def finished(server: BatchwireServer) -> bool:
    """Whether no stream reads ahead or holds read-ahead bytes any more."""
    readahead = server.engine.readahead
    assert readahead is not None
    stats = readahead.stats()
    return stats.streams == 0 and stats.held_bytes == 0 and stats.in_flight == 0


def test_a_cold_epoch_read_ahead_is_the_warm_epoch_one_at_a_time(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    copy = tmp_path / "datasets"
    shutil.copytree(data_dir, copy)
    warm_server = start_server(copy, read_ahead_reads=0)
    try:
        epoch_ids(warm_server, 2)  # the pages are in the page cache now
        warm = epoch_ids(warm_server, 2)
    finally:
        warm_server.stop(grace=1.0)
    evict(copy / "shapes")
    server = start_server(copy, read_ahead_reads=4, read_ahead_mib=1)
    try:
        cold = epoch_ids(server, 2)
        assert cold == warm and len(cold[0]) == 520 // 2  # every sample, the last batch short
        readahead = server.engine.readahead
        assert readahead is not None
        assert within(30.0, lambda: finished(server)), "timed out waiting for the read-ahead"
        stats = readahead.stats()
        assert stats.records > 0 and stats.peak_held_bytes <= 1 << 20
        assert server.engine.stages.snapshot()["read"] > 0
    finally:
        server.stop(grace=1.0)


def test_a_corrupt_record_and_a_stream_closed_mid_read_ahead(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    copy = tmp_path / "datasets"
    shutil.copytree(data_dir, copy)
    damage = {5: truncated(copy / "shapes", 5), 300: b"not a datum"}
    corrupt(copy / "shapes", damage)
    evict(copy / "shapes")
    server = start_server(copy, read_ahead_reads=4, read_ahead_mib=1)
    try:
        loader = small_loader(server, drop_last=False)
        with loader:
            # A stream closed after its first batch, its next batches being read ahead.
            next(iter(loader))
        assert within(30.0, lambda: finished(server)), "timed out waiting for the read-ahead"
        assert server.engine.readahead is not None
        assert server.engine.readahead.stats().records > 0
        loader = small_loader(server, drop_last=False)
        with loader:
            delivered = [int(i) for _, _, ids in loader for i in ids]
        assert sorted(loader.skipped_ids) == sorted(damage)
        assert sorted(delivered) == sorted(set(range(520)) - set(damage))
        assert within(30.0, lambda: finished(server)), "timed out waiting for the read-ahead"
    finally:
        server.stop(grace=1.0)
