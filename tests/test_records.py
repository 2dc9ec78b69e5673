"""The record path: a Datum's image found in place, and records read by their offset."""

from __future__ import annotations

import io
import pathlib
import random
import shutil

import lmdb
import numpy as np
import pytest
from PIL import Image

from batchwire.server.data import Dataset, Manifest, sample_key
from batchwire.server.data.records._datum import datum_image
from batchwire.v1 import datum_pb2


def test_the_datum_walk_agrees_with_protobuf_on_fuzzed_records() -> None:
    """Where protobuf parses a record into a Datum with image bytes, the walk finds the same
    bytes and label; where protobuf refuses it or it holds no image, so does the walk."""
    rng = random.Random(0)
    parsed = 0
    for _ in range(20000):
        datum = datum_pb2.Datum(
            data=rng.randbytes(rng.randint(0, 40)),
            label=rng.randint(-(2**31), 2**31 - 1),
            encoded=True,
            channels=rng.randint(0, 3),
        )
        if rng.random() < 0.2:
            datum.float_data.extend([1.0, 2.0])
        raw = bytearray(datum.SerializeToString())
        for _ in range(rng.randint(0, 3)):
            if raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        record = bytes(raw[: rng.randint(0, len(raw))] if rng.random() < 0.3 else raw)
        try:
            expected = datum_pb2.Datum.FromString(record)
        except Exception:  # protobuf's DecodeError
            expected = None
        found = datum_image(memoryview(record))
        if expected is None or not expected.data:
            assert found is None, record.hex()
            continue
        assert found is not None, record.hex()
        start, end, label = found
        assert record[start:end] == expected.data and label == expected.label, record.hex()
        parsed += 1
    assert parsed > 5000  # most records survive their damage: both paths are exercised


def test_records_are_read_by_offset_as_lmdb_holds_them(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Every record of every shard, small ones inside their leaf page included, is located
    by the shard's index and read as LMDB's own look-up reads it."""
    # A copy: LMDB opens a shard once per process, and other tests' servers hold these.
    shutil.copytree(data_dir / "shapes", tmp_path / "shapes")
    data_dir = tmp_path
    with Dataset(data_dir / "shapes") as dataset:
        ids = np.random.default_rng(0).permutation(dataset.num_samples)
        images, labels = dataset.read(ids)
        assert len(dataset.locate(ids)) == len(ids)
    manifest = Manifest.load(data_dir / "shapes")
    expected: dict[int, datum_pb2.Datum] = {}
    for shard in manifest.shards:
        env = lmdb.open(str(data_dir / "shapes" / shard.path), readonly=True, lock=False)
        with env.begin() as txn:
            for i in range(shard.first_id, shard.first_id + shard.count):
                expected[i] = datum_pb2.Datum.FromString(txn.get(sample_key(i)))
        env.close()
    for sample_id, image, label in zip(ids, images, labels, strict=True):
        assert image is not None
        assert image.tobytes() == expected[int(sample_id)].data
        assert label == expected[int(sample_id)].label


def test_a_screened_record_is_not_parsed_again_until_its_header_or_end_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from batchwire.server.data.records import _formats

    encoded = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 40, 10)).save(encoded, "JPEG")
    record = np.frombuffer(encoded.getvalue(), dtype=np.uint8).copy()
    screens, walks = [], []
    screen, walk = _formats.unsupported_reason, _formats._first_scan
    monkeypatch.setattr(_formats, "unsupported_reason", lambda d: screens.append(1) or screen(d))
    monkeypatch.setattr(_formats, "_first_scan", lambda d: walks.append(1) or walk(d))

    screened = _formats.ScreenedRecords(num_samples=1)
    assert screened.reason(0, record) is None
    first = (len(screens), len(walks))
    for _ in range(3):  # every later read: the checksum of its header, nothing parsed
        assert screened.reason(0, record) is None
    assert (len(screens), len(walks)) == first

    header = record.copy()
    header[3] ^= 0xFF  # rot inside the marker segments
    assert screened.reason(0, header) is not None  # screened again: not a JPEG header now
    assert len(screens) == first[0] + 1
    cut = record[:-1].copy()  # cut short: no end-of-image marker
    assert screened.reason(0, cut) is not None
    assert screened.reason(0, record) is None  # the good bytes again still pass


def test_a_batch_is_screened_record_by_record() -> None:
    from batchwire.server.data.records._formats import ScreenedRecords

    def jpeg(colour: tuple[int, int, int]) -> np.ndarray:
        encoded = io.BytesIO()
        Image.new("RGB", (32, 24), colour).save(encoded, "JPEG")
        return np.frombuffer(encoded.getvalue(), dtype=np.uint8).copy()

    good, other = jpeg((200, 40, 10)), jpeg((10, 40, 200))
    rotted = good.copy()
    rotted[3] ^= 0xFF
    text = np.frombuffer(b"not an image at all, only text", dtype=np.uint8)
    screened = ScreenedRecords(num_samples=4)
    ids = np.array([0, 1, 2, 3])
    assert screened.reasons(ids, [good, other, good, text])[:3] == [None, None, None]
    # The same ids again, two of them changed on disk since: each judged on its own bytes.
    reasons = screened.reasons(ids, [good, rotted, good[:-1].copy(), text])
    assert reasons[0] is None
    assert all(reason is not None for reason in reasons[1:])
    assert screened.reasons(ids[:2], [good, other]) == [None, None]  # remembered, not lost
