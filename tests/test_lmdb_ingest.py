"""Existing LMDBs: Caffe's convert_imageset output and seed 001's pickled layout ingest,
serve and stream; a pickle that would run code is refused and nothing of it runs."""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from collections.abc import Iterator

import lmdb
import numpy as np
import pytest
import skimage.data
import torch
from conftest import start_server
from photos import encode
from PIL import Image

from batchwire.cli import main
from batchwire.client import RemoteLoader
from batchwire.server.data import Dataset, IngestError, Manifest, UnsafePickle, ingest, safe_loads
from batchwire.v1 import datum_pb2

CAT = skimage.data.chelsea()  # 300x451 RGB
COFFEE = skimage.data.coffee()  # 400x600 RGB
ASTRONAUT = skimage.data.astronaut()  # 512x512 RGB


def write_lmdb(path: pathlib.Path, items: list[tuple[bytes, bytes]], *, subdir: bool) -> None:
    """Write ``(key, value)`` records in committed transactions, as the source tools do."""
    env = lmdb.open(str(path), subdir=subdir, map_size=1 << 28)
    with env.begin(write=True) as txn:
        for key, value in items:
            txn.put(key, value)
    env.sync()
    env.close()


def datum(data: bytes, label: int, **fields: object) -> bytes:
    return datum_pb2.Datum(data=data, label=label, **fields).SerializeToString()  # type: ignore[arg-type]


def serve_all(data_dir: pathlib.Path, name: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    server = start_server(data_dir)
    try:
        with RemoteLoader(
            server.target,
            dataset=name,
            pipeline="val",
            batch_size=count,
            shuffle=False,
            drop_last=False,
            normalize=False,
            params={"size": 64, "resize": 72},
        ) as loader:
            images, labels = next(iter(loader))
            assert loader.skipped_ids == []
    finally:
        server.stop(grace=1.0)
    return images, labels


# -- Caffe -------------------------------------------------------------------------------


@pytest.fixture()
def caffe_lmdb(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, bytes]]:
    """An environment directory as `convert_imageset --encoded` writes it (plus a raw Datum
    as it writes without --encoded, and two records no decoder accepts)."""
    jpeg = encode(CAT, "JPEG", quality=90)
    png = encode(COFFEE[:200, :300], "PNG")
    webp = encode(ASTRONAUT, "WEBP", quality=80)
    raw = ASTRONAUT[::8, ::8]  # 64x64x3 RGB, stored as Caffe does: CHW, BGR
    raw_chw = np.ascontiguousarray(raw[..., ::-1].transpose(2, 0, 1))
    records = {
        "00000000_cat/chelsea.jpg": datum(jpeg, 0, encoded=True),
        "00000001_coffee/cup.png": datum(png, 1, encoded=True),
        "00000002_junk/random.jpg": datum(
            b"\xff\xd8\xff" + np.random.default_rng(3).bytes(3000), 1, encoded=True
        ),
        "00000003_space/astronaut.webp": datum(webp, 2, encoded=True),
        "00000004_space/raw.ppm": datum(
            raw_chw.tobytes(), 2, channels=3, height=64, width=64, encoded=False
        ),
        "00000005_junk/not-a-datum": b"\xff\xfe definitely not protobuf",
    }
    path = tmp_path / "caffe_train_lmdb"
    write_lmdb(path, [(k.encode(), v) for k, v in records.items()], subdir=True)
    originals = {"cat": jpeg, "coffee": png, "space": webp}
    return path, originals


def test_a_caffe_lmdb_ingests_without_reencoding_and_serves(
    caffe_lmdb: tuple[pathlib.Path, dict[str, bytes]],
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, originals = caffe_lmdb
    out = tmp_path / "datasets"
    assert main(["ingest", str(src), str(out), "--name", "caffe", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "ingested 4 images in 3 classes" in printed
    assert "00000002_junk/random.jpg: cannot be decoded" in printed
    assert "00000005_junk/not-a-datum: not a Caffe Datum" in printed

    manifest = Manifest.load(out / "caffe")
    assert manifest.classes == ("0", "1", "2")
    assert manifest.class_counts == (1, 1, 2)
    assert {r["path"] for r in manifest.rejected} == {
        "00000002_junk/random.jpg",
        "00000005_junk/not-a-datum",
    }
    with Dataset(out / "caffe") as dataset:
        stored, labels = dataset.read([0, 1, 2, 3])
    assert labels.tolist() == [0, 1, 2, 2]
    # The original encoded bytes, untouched, in key order.
    assert [bytes(s) for s in stored[:3]] == [  # type: ignore[arg-type]
        originals["cat"],
        originals["coffee"],
        originals["space"],
    ]
    # The raw Datum became a lossless PNG of the same RGB pixels.
    with Image.open(io.BytesIO(bytes(stored[3]))) as png:  # type: ignore[arg-type]
        assert png.format == "PNG"
        assert np.array_equal(np.asarray(png.convert("RGB")), ASTRONAUT[::8, ::8])

    images, served_labels = serve_all(out, "caffe", 4)
    assert tuple(images.shape) == (4, 3, 64, 64)
    assert served_labels.tolist() == [0, 1, 2, 2]


def test_an_lmdb_that_is_neither_layout_is_refused(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "other"
    write_lmdb(src, [(b"a", b"\x00\x01\x02 plain bytes")], subdir=True)
    with pytest.raises(IngestError, match="neither Caffe's format"):
        ingest(src, tmp_path / "out", name="other")
    assert not (tmp_path / "out" / "other").exists()


# -- seed 001's pickled layout -------------------------------------------------------------


def pickled_layout(images: list[tuple[bytes | str, object]]) -> list[tuple[bytes, bytes]]:
    """Records as seed 001 writes them: keys str(idx), pickled values, __keys__ and __len__."""
    records = [(f"{i}".encode("ascii"), pickle.dumps(item)) for i, item in enumerate(images)]
    keys = [key for key, _ in records]
    return [*records, (b"__keys__", pickle.dumps(keys)), (b"__len__", pickle.dumps(len(keys)))]


def test_a_pickled_lmdb_ingests_and_serves(tmp_path: pathlib.Path) -> None:
    jpeg = encode(CAT, "JPEG")
    png = encode(COFFEE, "PNG")
    items: list[tuple[bytes | str, object]] = [
        (jpeg, 1),
        (png, 0),
        (b"not an image at all", 0),
        (jpeg, "cat"),  # a label that is not a number
        (png, 1),
    ]
    # One file, no directory: what `lmdb.open(path, subdir=False)` in seed 001 makes.
    src = tmp_path / "train.lmdb"
    write_lmdb(src, pickled_layout(items), subdir=False)
    assert src.is_file()

    report = ingest(src, tmp_path / "datasets", name="pickled")
    assert report.num_samples == 3
    assert report.classes == ("0", "1")
    assert report.class_counts == (1, 2)
    reasons = {r.path: r.reason for r in report.rejected}
    assert set(reasons) == {"2", "3"}
    assert "not an image" in reasons["2"]
    assert "label is not an integer but a str" in reasons["3"]
    with Dataset(tmp_path / "datasets" / "pickled") as dataset:
        stored, labels = dataset.read([0, 1, 2])
    assert [bytes(s) for s in stored] == [jpeg, png, png]  # type: ignore[arg-type]
    assert labels.tolist() == [1, 0, 1]

    images, served_labels = serve_all(tmp_path / "datasets", "pickled", 3)
    assert tuple(images.shape) == (3, 3, 64, 64)
    assert served_labels.tolist() == [1, 0, 1]
    assert torch.equal(images[0], serve_one_jpeg(tmp_path, jpeg))


def serve_one_jpeg(tmp_path: pathlib.Path, jpeg: bytes) -> torch.Tensor:
    """The same JPEG ingested from a class folder: the served pixels must be identical."""
    (tmp_path / "folder" / "a").mkdir(parents=True)
    (tmp_path / "folder" / "a" / "x.jpg").write_bytes(jpeg)
    ingest(tmp_path / "folder", tmp_path / "ref", name="ref")
    images, _ = serve_all(tmp_path / "ref", "ref", 1)
    return images[0]


class _Payload:
    """Unpickling this creates ``path``: the side effect a malicious record would have."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, ...]:
        return (open, (self.path, "w"))


def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path: pathlib.Path) -> None:
    # The payload is live: plain pickle.loads would create the file.
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Payload(proof))).close()
    assert proof.exists()

    marker = tmp_path / "pwned"
    jpeg = encode(CAT, "JPEG")
    records = pickled_layout([(jpeg, 0), (jpeg, 1)])
    records[1] = (b"1", pickle.dumps((jpeg, _Payload(marker))))
    src = tmp_path / "evil.lmdb"
    write_lmdb(src, records, subdir=False)

    with pytest.raises(IngestError) as caught:
        ingest(src, tmp_path / "datasets", name="evil")
    message = str(caught.value)
    assert "record '1' was refused" in message
    assert "io.open (opcode STACK_GLOBAL)" in message
    assert "never runs code" in message
    assert not marker.exists()
    assert not (tmp_path / "datasets" / "evil").exists()
    assert [p.name for p in (tmp_path / "datasets").iterdir()] == []  # no partial directory

    # The same payload as __keys__ is refused before any record is read.
    src2 = tmp_path / "evil-keys"
    write_lmdb(
        src2,
        [(b"0", pickle.dumps((jpeg, 0))), (b"__keys__", pickle.dumps(_Payload(marker)))],
        subdir=True,
    )
    with pytest.raises(IngestError, match="record '__keys__' was refused"):
        ingest(src2, tmp_path / "datasets", name="evil2")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"cos\nsystem\n(S'touch x'\ntR.", "imports os.system (opcode GLOBAL)"),
        (b"\x80\x04\x8c\x02os\x8c\x06system\x93.", "imports os.system (opcode STACK_GLOBAL)"),
        (b"\x80\x04N)R.", "opcode REDUCE"),
        (b"(ios\nsystem\nS'x'\n.", "opcode INST"),
        (b"\x80\x02(N)o.", "opcode OBJ"),
        (b"\x80\x02N)\x81.", "opcode NEWOBJ"),
        (b"\x80\x04N)}\x92.", "opcode NEWOBJ_EX"),
        (b"\x80\x02N}b.", "opcode BUILD"),
        (b"\x80\x02\x82\x01.", "opcode EXT1"),
        (b"\x80\x02Pabc\n.", "opcode PERSID"),
        (b"\x80\x02N\x85Q.", "opcode BINPERSID"),
        (b"\x80\x05\x97.", "opcode NEXT_BUFFER"),
        (pickle.dumps({1, 2}), "opcode EMPTY_SET"),
        (pickle.dumps((b"abc", 1), protocol=2), "imports _codecs.encode"),
        (b"\x80\x04\x95", "not a valid pickle"),
        (b"", "empty"),
    ],
)
def test_safe_loads_refuses_anything_but_plain_data(payload: bytes, words: str) -> None:
    with pytest.raises(UnsafePickle, match=words.replace("(", r"\(").replace(")", r"\)")):
        safe_loads(payload)


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_safe_loads_reads_plain_values(protocol: int) -> None:
    value = (b"\xff\xd8jpeg", 7, [1.5, "x", None, True], {"k": (b"", -3)})
    assert safe_loads(pickle.dumps(value, protocol=protocol)) == value
    # Python 2 strings come back as bytes.
    assert safe_loads(b"\x80\x02U\x03abcq\x00K\x05\x86q\x01.") == (b"abc", 5)


def test_ingest_refuses_a_file_list_with_an_lmdb(
    caffe_lmdb: tuple[pathlib.Path, dict[str, bytes]], tmp_path: pathlib.Path
) -> None:
    src, _ = caffe_lmdb
    listing = tmp_path / "list.txt"
    listing.write_text("a.jpg 0\n")
    with pytest.raises(IngestError, match="drop --file-list"):
        ingest(src, tmp_path / "out", name="x", file_list=listing)


@pytest.fixture(autouse=True)
def _no_stray_files(tmp_path: pathlib.Path) -> Iterator[None]:
    before = set(os.listdir(pathlib.Path.cwd()))
    yield
    assert set(os.listdir(pathlib.Path.cwd())) <= before | {".pytest_cache"}, (
        "files leaked into cwd"
    )
