"""A record's named fields: the ``Fields`` message beside the image and label, found in place,
read back exactly, declared by the manifest; records and manifests made before fields existed
read as before, and DALI's own Caffe reader still reads a record that has fields."""

from __future__ import annotations

import io
import json
import pathlib
import random

import lmdb
import numpy as np
import pytest
from PIL import Image

from batchwire.server.data import (
    MANIFEST,
    Dataset,
    DatasetError,
    FieldSpec,
    Manifest,
    decode_fields,
    encode_fields,
    sample_key,
)
from batchwire.server.data.records._datum import datum_fields, datum_image
from batchwire.v1 import datum_pb2


def jpeg(colour: tuple[int, int, int], size: tuple[int, int] = (48, 32)) -> bytes:
    encoded = io.BytesIO()
    Image.new("RGB", size, colour).save(encoded, "JPEG")
    return encoded.getvalue()


SAMPLE_FIELDS = {
    "boxes": ("float", np.array([[1.5, 2.0, 30.0, 20.25], [0.0, 0.0, 4.0, 4.0]], np.float32)),
    "labels": ("int", np.array([3, 0], np.int64)),
    "caption": ("text", ("a red square", "ein rotes Quadrat ✓")),
    "title": ("text", "one string"),
    "weight": ("float", np.float32(0.5)),
    "multi": ("int", np.array([[1, 0, 1], [0, 1, 1]], np.int64)),
    "blob": ("bytes", b"\x00\xffraw"),
    "mask": ("image", b"\x89PNG..."),
    "empty": ("float", np.zeros((0, 4), np.float32)),
}


def assert_same(got: dict[str, object], want: dict[str, tuple[str, object]]) -> None:
    assert list(got) == list(want)
    for name, (kind, value) in want.items():
        if kind in ("int", "float"):
            array = got[name]
            assert isinstance(array, np.ndarray)
            assert array.dtype == (np.int64 if kind == "int" else np.float32), name
            assert array.shape == np.shape(value), name
            np.testing.assert_array_equal(array, value)
        else:
            assert got[name] == value, name


def write_dataset(
    directory: pathlib.Path, records: list[bytes], manifest: dict[str, object]
) -> None:
    shard = directory / "shard-00000"
    shard.mkdir(parents=True)
    with lmdb.open(str(shard), map_size=1 << 24) as env, env.begin(write=True) as txn:
        for i, record in enumerate(records):
            txn.put(sample_key(i), record)
    (directory / MANIFEST).write_text(json.dumps(manifest))


def old_manifest(name: str, count: int) -> dict[str, object]:
    """A manifest as batchwire wrote it before fields existed."""
    return {
        "format": "batchwire-dataset",
        "name": name,
        "num_samples": count,
        "classes": ["a", "b"],
        "class_counts": [count - count // 2, count // 2],
        "shards": [{"path": "shard-00000", "first_id": 0, "count": count}],
        "total_bytes": 0,
        "source": "",
        "created": "",
        "rejected": [],
        "format_version": 1,
    }


def test_fields_read_back_exactly_beside_image_and_label() -> None:
    datum = datum_pb2.Datum(data=jpeg((200, 0, 0)), label=7, encoded=True)
    datum.fields.CopyFrom(encode_fields(SAMPLE_FIELDS))
    record = datum.SerializeToString()
    assert_same(decode_fields(record), SAMPLE_FIELDS)
    found = datum_image(memoryview(record))
    assert found is not None
    start, end, label = found
    assert record[start:end] == datum.data and label == 7


def test_the_fields_walk_agrees_with_protobuf_on_fuzzed_records() -> None:
    """Where protobuf parses a record, the walk finds its fields exactly where protobuf does
    (or none); a record without fields is never handed to protobuf."""
    rng = random.Random(1)
    with_fields = 0
    for _ in range(5000):
        datum = datum_pb2.Datum(data=rng.randbytes(rng.randint(0, 30)), label=rng.randint(0, 9))
        if rng.random() < 0.5:
            datum.fields.CopyFrom(
                encode_fields({"n": ("int", rng.sample(range(100), rng.randint(0, 4)))})
            )
        raw = bytearray(datum.SerializeToString())
        for _ in range(rng.randint(0, 2)):
            if raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        record = bytes(raw)
        try:
            expected = datum_pb2.Datum.FromString(record)
        except Exception:  # protobuf's DecodeError
            continue
        span = datum_fields(memoryview(record))
        if not expected.HasField("fields"):
            assert span is None, record.hex()
            continue
        assert span is not None, record.hex()
        assert datum_pb2.Fields.FromString(span.tobytes()) == expected.fields, record.hex()
        with_fields += 1
    assert with_fields > 1000


def test_a_value_of_the_wrong_kind_is_refused() -> None:
    for kind, value in [("int", [1.5, 2.0]), ("int", "7"), ("text", 5), ("text", ["a", 1])]:
        with pytest.raises(ValueError, match="is not"):
            encode_fields({"x": (kind, value)})


def test_a_dataset_made_before_fields_reads_as_before(tmp_path: pathlib.Path) -> None:
    """Records without ``fields`` and a manifest without ``fields`` or ``class_ids``: the
    images and labels read as ever, the manifest declares no fields, every record has none."""
    images = [jpeg((10 * i, 0, 0)) for i in range(4)]
    records = [
        datum_pb2.Datum(data=image, label=i % 2, encoded=True).SerializeToString()
        for i, image in enumerate(images)
    ]
    write_dataset(tmp_path / "old", records, old_manifest("old", 4))
    with Dataset(tmp_path / "old") as dataset:
        assert dataset.manifest.fields == () and dataset.manifest.class_ids == ()
        read, labels = dataset.read([3, 0, 2])
        assert [r.tobytes() for r in read if r is not None] == [images[3], images[0], images[2]]
        assert labels.tolist() == [1, 0, 0]
        assert dataset.fields([0, 1, 2, 3]) == [{}, {}, {}, {}]
    # Written again, the old manifest keeps its shape: no empty fields or class_ids added.
    body = json.loads(Manifest.load(tmp_path / "old").to_json())
    assert "fields" not in body and "class_ids" not in body


def test_dataset_fields_reads_each_records_fields(tmp_path: pathlib.Path) -> None:
    records = []
    for i in range(3):
        datum = datum_pb2.Datum(data=jpeg((0, 50 * i, 0)), label=i, encoded=True)
        if i != 1:  # sample 1 holds no fields
            datum.fields.CopyFrom(encode_fields(SAMPLE_FIELDS))
        records.append(datum.SerializeToString())
    manifest = old_manifest("new", 3) | {
        "fields": {"boxes": {"kind": "float", "dtype": "float32", "shape": [-1, 4]}}
    }
    write_dataset(tmp_path / "new", records, manifest)
    with Dataset(tmp_path / "new") as dataset:
        got = dataset.fields([2, 1, 0])
        assert got[1] == {}
        assert_same(got[0], SAMPLE_FIELDS)
        assert_same(got[2], SAMPLE_FIELDS)
        _, labels = dataset.read([0, 1, 2])
        assert labels.tolist() == [0, 1, 2]


def test_the_manifest_declares_its_fields() -> None:
    manifest = Manifest(
        name="coco",
        num_samples=0,
        classes=("person", "dog"),
        class_counts=(0, 0),
        class_ids=(1, 18),
        shards=(),
        fields=(
            FieldSpec(
                name="boxes",
                kind="float",
                shape=(-1, 4),
                format="ltrb",
                samples=2,
                count_min=1,
                count_max=3,
                count_total=4,
            ),
            FieldSpec(name="labels", kind="int", shape=(-1,), format="class", along="boxes"),
            FieldSpec(name="caption", kind="text", shape=(-1,)),
        ),
    )
    body = json.loads(manifest.to_json())
    assert body["class_ids"] == [1, 18]
    assert body["fields"]["boxes"] == {
        "kind": "float",
        "dtype": "float32",
        "shape": [-1, 4],
        "format": "ltrb",
        "along": "",
        "samples": 2,
        "count_min": 1,
        "count_max": 3,
        "count_total": 4,
    }
    assert body["fields"]["caption"]["dtype"] == "str"
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.fields[0].count_mean == 2.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"boxes": {"kind": "vector"}}, "kind 'vector'"),
        ({"boxes": {"kind": "int", "dtype": "float32"}}, "dtype"),
        ({"boxes": {"kind": "int", "shape": [-1, 4], "format": "ltrb"}}, "boxes"),
        ({"labels": {"kind": "int", "along": "boxes"}}, "not a field"),
        ({"no spaces": {"kind": "int"}}, "not allowed"),
    ],
)
def test_a_bad_schema_is_a_dataset_error(fields: dict[str, object], message: str) -> None:
    text = json.dumps(
        old_manifest("x", 0) | {"shards": [], "class_counts": [0, 0], "fields": fields}
    )
    with pytest.raises(DatasetError, match=message):
        Manifest.from_json(text)


def test_dalis_caffe_reader_reads_records_with_fields(tmp_path: pathlib.Path) -> None:
    """DALI's ``fn.readers.caffe`` skips ``fields`` as an unknown field: image and label as
    written."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def

    images = [jpeg((40 * i, 80, 0)) for i in range(4)]
    records = []
    for i, image in enumerate(images):
        datum = datum_pb2.Datum(data=image, label=i + 10, encoded=True)
        datum.fields.CopyFrom(encode_fields(SAMPLE_FIELDS))
        records.append(datum.SerializeToString())
    write_dataset(tmp_path / "d", records, old_manifest("d", 4))

    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def read() -> object:
        encoded, labels = fn.readers.caffe(path=str(tmp_path / "d" / "shard-00000"))
        return encoded, labels

    pipe = read()
    pipe.build()
    encoded, labels = pipe.run()
    assert [np.array(encoded[i]).tobytes() for i in range(4)] == images
    assert [int(np.array(labels[i])[0]) for i in range(4)] == [10, 11, 12, 13]
