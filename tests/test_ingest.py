"""``batchwire ingest`` and ``batchwire inspect`` on real photos, real DALI, real LMDB."""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import pathlib
import pty
import re
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")
lmdb = pytest.importorskip("lmdb")

from photos import (  # noqa: E402
    PhotoTree,
    build_photo_tree,
    build_repeated_tree,
    impossible_huffman_table,
)

from batchwire.cli import main  # noqa: E402
from batchwire.server.data import (  # noqa: E402  # noqa: E402
    MANIFEST,
    Dataset,
    IngestError,
    IngestReport,
    Manifest,
    ingest,
    manifest_version,
    sample_key,
)
from batchwire.v1 import datum_pb2  # noqa: E402

SHARD_SIZE = 4


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> PhotoTree:
    return build_photo_tree(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module")
def report(tree: PhotoTree, tmp_path_factory: pytest.TempPathFactory) -> IngestReport:
    return ingest(tree.root, tmp_path_factory.mktemp("out"), name="photos", shard_size=SHARD_SIZE)


def dali_decode(blobs: list[bytes]) -> list[np.ndarray]:
    """Decode with DALI's CPU decoder, as the server does (RGB, HWC uint8)."""
    from nvidia.dali import Pipeline, fn, types

    pipe = Pipeline(batch_size=len(blobs), num_threads=2, device_id=None)
    with pipe:
        encoded = fn.external_source(name="encoded", dtype=types.DALIDataType.UINT8, ndim=1)
        pipe.set_outputs(
            fn.decoders.image(encoded, device="cpu", output_type=types.DALIImageType.RGB)
        )
    pipe.build()
    pipe.feed_input("encoded", [np.frombuffer(b, dtype=np.uint8) for b in blobs])
    (images,) = pipe.run()
    return [np.array(images[i]) for i in range(len(images))]


def caffe_read(shard: pathlib.Path, count: int) -> tuple[list[bytes], list[int], list[np.ndarray]]:
    """One epoch of a shard through DALI's own ``fn.readers.caffe``: bytes, labels, pixels."""
    from nvidia.dali import Pipeline, fn, types

    pipe = Pipeline(batch_size=count, num_threads=2, device_id=None)
    with pipe:
        # The stubs type a multi-output reader as one node.
        records: Any = fn.readers.caffe(path=str(shard), name="Reader")
        encoded, labels = records
        images = fn.decoders.image(encoded, device="cpu", output_type=types.DALIImageType.RGB)
        pipe.set_outputs(encoded, labels, images)
    pipe.build()
    assert pipe.epoch_size("Reader") == count
    out_encoded, out_labels, out_images = pipe.run()
    return (
        [np.array(out_encoded[i]).tobytes() for i in range(count)],
        [int(np.array(out_labels[i]).reshape(-1)[0]) for i in range(count)],
        [np.array(out_images[i]) for i in range(count)],
    )


def read_datums(dataset: pathlib.Path) -> dict[int, datum_pb2.Datum]:
    datums = {}
    for shard in Manifest.load(dataset).shards:
        env = lmdb.open(str(dataset / shard.path), readonly=True, lock=False)
        with env.begin() as txn:
            for i in range(shard.first_id, shard.first_id + shard.count):
                datums[i] = datum_pb2.Datum.FromString(txn.get(sample_key(i)))
        env.close()
    return datums


def leftovers(out: pathlib.Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("."))


def test_keeps_every_valid_image_with_per_class_counts(
    tree: PhotoTree, report: IngestReport
) -> None:
    manifest = Manifest.load(report.path)
    assert report.num_samples == manifest.num_samples == len(tree.photos)
    assert report.classes == manifest.classes == tree.classes
    assert list(report.class_counts) == list(manifest.class_counts) == tree.counts() == [5, 6, 3]
    assert [(s.path, s.first_id, s.count) for s in manifest.shards] == [
        ("shard-00000", 0, 4),
        ("shard-00001", 4, 4),
        ("shard-00002", 8, 4),
        ("shard-00003", 12, 2),
    ]
    for shard in manifest.shards:
        assert (report.path / shard.path / "data.mdb").is_file()
    originals = [tree.path(p.relpath).read_bytes() for p in tree.photos]
    assert report.bytes == manifest.total_bytes == sum(len(b) for b in originals)
    assert manifest.source == str(tree.root.resolve())
    created = datetime.datetime.fromisoformat(manifest.created)
    assert created.utcoffset() == datetime.timedelta(0)
    # The dataset directory is readable by a server running as another user.
    assert report.path.stat().st_mode & 0o055 == 0o055 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_names_every_rejected_file_with_a_reason(tree: PhotoTree, report: IngestReport) -> None:
    expected = sorted([*tree.stray, *tree.bad])
    assert sorted(r.path for r in report.rejected) == expected
    on_disk = Manifest.load(report.path).rejected
    assert [(r["path"], r["reason"]) for r in on_disk] == [
        (r.path, r.reason) for r in report.rejected
    ]
    reasons = {r.path: r.reason for r in report.rejected}
    assert "GIF" in reasons["space/anim.gif"]
    assert "empty" in reasons["coffee/empty.jpg"]
    assert "truncated" in reasons["cat/truncated.jpg"]
    assert "decode" in reasons["space/random.jpg"]
    assert "class folder" in reasons["README.txt"]
    named = {r.path for r in report.rejected} | {p.relpath for p in tree.photos}
    assert not named & set(tree.hidden)


def test_dataset_read_returns_original_bytes_and_label(
    tree: PhotoTree, report: IngestReport
) -> None:
    with Dataset(report.path) as dataset:
        images, labels = dataset.read(range(dataset.num_samples))
    for sample_id, photo in enumerate(tree.photos):
        assert images[sample_id] is not None
        assert images[sample_id].tobytes() == tree.path(photo.relpath).read_bytes(), photo
        assert labels[sample_id] == photo.label, photo


def test_datum_records_the_shape_dali_decodes(tree: PhotoTree, report: IngestReport) -> None:
    from PIL import Image

    datums = read_datums(report.path)
    decoded = dali_decode([tree.path(p.relpath).read_bytes() for p in tree.photos])
    for sample_id, photo in enumerate(tree.photos):
        datum = datums[sample_id]
        assert datum.encoded
        assert (datum.height, datum.width, datum.channels) == decoded[sample_id].shape, photo
    shapes = {p.kind: (datums[i].height, datums[i].width) for i, p in enumerate(tree.photos)}
    assert shapes["tiny png"] == (3, 4)
    assert shapes["huge jpeg"] == (3000, 4000)
    # EXIF orientation 6 is applied: the stored 451x300 grid decodes as 300 wide.
    with Image.open(tree.path("cat/rotated.jpg")) as stored:
        assert stored.size == (451, 300)
    assert shapes["exif-rotated jpeg"] == (451, 300)


def test_dali_caffe_reader_reads_every_shard(tree: PhotoTree, report: IngestReport) -> None:
    manifest = Manifest.load(report.path)
    for shard in manifest.shards:
        photos = tree.photos[shard.first_id : shard.first_id + shard.count]
        originals = [tree.path(p.relpath).read_bytes() for p in photos]
        encoded, labels, images = caffe_read(report.path / shard.path, shard.count)
        assert encoded == originals
        assert labels == [p.label for p in photos]
        for image, expected, photo in zip(images, dali_decode(originals), photos, strict=True):
            assert image.shape == expected.shape, photo
            assert np.array_equal(image, expected), photo


def test_ids_are_deterministic_and_cli_reports_rejections(
    tree: PhotoTree,
    report: IngestReport,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Another ingest of the same tree, through the CLI and with other shards.
    argv = ["ingest", str(tree.root), str(tmp_path), "--name", "again", "--no-progress"]
    assert main([*argv, "--shard-size", "5"]) == 0
    stdout = capsys.readouterr().out
    assert f"ingested {len(tree.photos)} images in 3 classes" in stdout
    assert f"rejected {len(tree.bad) + len(tree.stray)} files" in stdout
    for relpath in [*tree.bad, *tree.stray]:
        assert relpath in stdout
    with Dataset(report.path) as first, Dataset(tmp_path / "again") as second:
        assert second.num_samples == first.num_samples
        ids = range(first.num_samples)
        first_images, first_labels = first.read(ids)
        second_images, second_labels = second.read(ids)
    assert [a.tobytes() for a in first_images] == [b.tobytes() for b in second_images]
    assert list(first_labels) == list(second_labels)
    assert [s.count for s in Manifest.load(tmp_path / "again").shards] == [5, 5, 4]


def _write_file_list(src: pathlib.Path, tree: PhotoTree) -> pathlib.Path:
    (src / "my photos").mkdir(parents=True)
    shutil.copy(tree.path("cat/chelsea.jpg"), src / "my photos" / "a cat.jpg")
    for relpath in ("coffee/coffee.bmp", "space/anim.gif", "cat/tiny.png"):
        (src / relpath).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tree.path(relpath), src / relpath)
    listing = src.parent / "files.txt"
    listing.write_text(
        "# path label\n"
        "\n"
        "coffee/coffee.bmp 2\n"
        "my photos/a cat.jpg   0\n"
        "space/anim.gif 1\n"
        "missing.jpg 1\n"
        "cat 1\n"
        "cat/tiny.png 4\n"
        "coffee/coffee.bmp 2\n"
    )
    return listing


def test_a_file_the_decoder_rejects_is_decoded_once_and_named_in_the_summary(
    tree: PhotoTree, tmp_path: pathlib.Path, capfd: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    for relpath in ("cat/chelsea.jpg", "cat/truncated.jpg", "coffee/coffee.ppm"):
        shutil.copy(tree.path(relpath), src / "cat")
    chelsea = tree.path("cat/chelsea.jpg").read_bytes()
    (src / "cat" / "huffman.jpg").write_bytes(impossible_huffman_table(chelsea))
    argv = ["ingest", str(src), str(tmp_path / "out"), "--name", "one", "--no-progress"]
    assert main(argv) == 0
    out, err = capfd.readouterr()
    assert "ingested 2 images in 1 class into" in out
    assert "(1 shard, " in out  # counts in words: "1 shard", not "1 shards"
    assert "cat/truncated.jpg: cannot be decoded: its JPEG is truncated" in out  # screened
    assert "cat/huffman.jpg: corrupt or truncated image data" in out  # failed in DALI
    # DALI's decoder prints its own [ERROR] line (to fd 2, from C++) each time it fails
    # on the file: once, not again when its batch is checked file by file.
    assert err.count("Could not decode jpeg") <= 1, err


def test_file_list_ingest(tree: PhotoTree, tmp_path: pathlib.Path) -> None:
    src = tmp_path / "src"
    listing = _write_file_list(src, tree)
    result = ingest(src, tmp_path / "out", name="listed", file_list=listing)
    assert result.classes == ("0", "1", "2", "3", "4")
    assert result.class_counts == (1, 0, 2, 0, 1)
    assert {r.path: r.reason for r in result.rejected} == {
        "space/anim.gif": "GIF: DALI's image decoder does not support GIF",
        "missing.jpg": "cannot read: No such file or directory",
        "cat": "not a regular file",
    }
    expected = [
        ("coffee/coffee.bmp", 2),
        ("my photos/a cat.jpg", 0),
        ("cat/tiny.png", 4),
        ("coffee/coffee.bmp", 2),
    ]
    with Dataset(result.path) as dataset:
        images, labels = dataset.read(range(dataset.num_samples))
    assert [(img.tobytes(), int(lab)) for img, lab in zip(images, labels, strict=True)] == [
        ((src / path).read_bytes(), label) for path, label in expected
    ]


@pytest.mark.parametrize(
    ("line", "complaint"),
    [("cat/tiny.png", "expected 'relative/path label'"), ("cat/tiny.png four", "not an integer")],
)
def test_file_list_malformed_line_is_a_clear_error(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], line: str, complaint: str
) -> None:
    listing = tmp_path / "files.txt"
    listing.write_text(f"# header\ncat/tiny.png 0\n{line}\n")
    out = tmp_path / "out"
    argv = ["ingest", str(tmp_path), str(out), "--name", "x", "--file-list", str(listing)]
    assert main(argv) == 2
    stderr = capsys.readouterr().err.strip().splitlines()
    assert len(stderr) == 1
    assert stderr[0].startswith("error: ")
    assert "line 3" in stderr[0] and complaint in stderr[0]
    assert not out.exists() or list(out.iterdir()) == []


def test_existing_dataset_needs_overwrite_and_is_replaced_whole(
    tree: PhotoTree,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    listing = tmp_path / "two.txt"
    listing.write_text("cat/chelsea.jpg 0\ncat/tiny.png 1\n")
    out = tmp_path / "out"
    base = ["ingest", str(tree.root), str(out), "--name", "ds", "--no-progress"]
    caplog.set_level(logging.DEBUG, logger="batchwire")
    assert main([*base, "--file-list", str(listing)]) == 0
    assert "ingesting 2 files" in caplog.text
    caplog.clear()
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    listing.write_text("coffee/coffee.ppm 0\n")
    assert main([*base, "--file-list", str(listing)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err
    assert "ingesting" not in caplog.text, "refused before reading the source"
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert leftovers(out) == []

    assert main([*base, "--file-list", str(listing), "--overwrite"]) == 0
    with Dataset(out / "ds") as dataset:
        assert dataset.num_samples == 1
        images, _ = dataset.read([0])
    assert images[0].tobytes() == tree.path("coffee/coffee.ppm").read_bytes()
    assert leftovers(out) == []


def test_overwrite_refuses_to_replace_a_directory_that_is_not_a_dataset(
    tree: PhotoTree, tmp_path: pathlib.Path
) -> None:
    (tmp_path / "out" / "ds").mkdir(parents=True)
    (tmp_path / "out" / "ds" / "notes.txt").write_text("mine")
    with pytest.raises(IngestError, match="not a batchwire dataset"):
        ingest(tree.root, tmp_path / "out", name="ds", overwrite=True)
    assert (tmp_path / "out" / "ds" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", ""])
def test_bad_name_is_a_clear_error(
    tree: PhotoTree, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    assert main(["ingest", str(tree.root), str(tmp_path / "out"), "--name", name]) == 2
    assert "is not allowed" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_source_without_a_decodable_image_is_an_error_and_leaves_nothing(
    tree: PhotoTree, tmp_path: pathlib.Path
) -> None:
    src = tmp_path / "src"
    (src / "only").mkdir(parents=True)
    for relpath in ("space/anim.gif", "coffee/empty.jpg"):
        shutil.copy(tree.path(relpath), src / "only")
    out = tmp_path / "out"
    with pytest.raises(IngestError, match="no decodable image") as caught:
        ingest(src, out, name="nothing")
    assert "anim.gif" in str(caught.value)
    assert list(out.iterdir()) == []


def test_interrupted_ingest_leaves_no_dataset_and_no_temporary_directory(
    tmp_path: pathlib.Path,
) -> None:
    count = 3000
    src = build_repeated_tree(tmp_path / "src", count)
    out = tmp_path / "out"
    # Ctrl-C as in a terminal: a process started in the background by a shell (as a CI
    # runner may start this one) inherits SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler, so the child sets it itself.
    ctrl_c = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from batchwire.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    # stderr a terminal, where the progress bar is drawn: its first update says the ingest
    # is under way.
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-c", ctrl_c, "ingest", str(src), str(out), "--name", "big"],
        stdout=subprocess.PIPE,
        stderr=follower,
        cwd=tmp_path,
    )
    os.close(follower)
    try:
        seen = _read_until(leader, re.compile(rb"\b[1-9]\d*/%d\b" % count), timeout=60)
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        rest = _read_until(leader, None, timeout=10)
    finally:
        proc.kill()
        proc.wait()
        os.close(leader)
    stderr = (seen + rest).decode(errors="replace")
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert list(out.iterdir()) == [], stderr


def _read_until(terminal: int, pattern: re.Pattern[bytes] | None, timeout: float) -> bytes:
    """What the child wrote to the ``terminal`` (a pseudo-terminal's leader) up to the first
    match of ``pattern`` (a progress update), or with None to its end."""
    deadline = time.monotonic() + timeout
    seen = b""
    with selectors.DefaultSelector() as selector:
        selector.register(terminal, selectors.EVENT_READ)
        while pattern is None or not pattern.search(seen):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                if pattern is None:
                    return seen
                pytest.fail(f"no progress within {timeout} s: {seen.decode(errors='replace')}")
            try:
                chunk = os.read(terminal, 65536)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk:
                if pattern is None:
                    return seen
                pytest.fail(f"ingest ended before any progress: {seen.decode(errors='replace')}")
            seen += chunk
    return seen


def test_inspect_prints_counts(
    tree: PhotoTree, report: IngestReport, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(report.path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^samples\s+14$", out, re.M)
    version = manifest_version((report.path / "manifest.json").read_bytes())
    assert re.search(rf"^version\s+{version}\s", out, re.M)
    for label, (name, count) in enumerate(zip(tree.classes, tree.counts(), strict=True)):
        assert re.search(rf"^\s+{label}\s+{name}\s+{count}$", out, re.M), out
    assert out.count("4 samples") == 3 and "shard-00003  ids 12..13  2 samples" in out
    assert re.search(r"^rejected\s+5$", out, re.M)
    assert "space/anim.gif" in out
    assert "ok" in out.splitlines()[-1]


def test_inspect_fails_when_a_shard_disagrees_with_the_manifest(
    report: IngestReport, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = shutil.copytree(report.path, tmp_path / "copy")
    body = json.loads((copy / MANIFEST).read_text())
    body["shards"][-1]["count"] -= 1
    body["num_samples"] -= 1
    (copy / MANIFEST).write_text(json.dumps(body))
    assert main(["inspect", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "shard-00003 holds 2 records but the manifest says 1" in err


def test_inspect_of_a_directory_that_is_not_a_dataset(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read") and "`batchwire ingest` makes one" in err
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert f"({tmp_path / 'missing'} does not exist)" in capsys.readouterr().err


def test_inspect_of_the_folder_that_holds_datasets_names_them(
    report: IngestReport, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = report.path.parent
    assert main(["inspect", str(parent)]) == 2
    err = capsys.readouterr().err
    assert f"{parent} holds datasets ({report.path.name}" in err
    assert f"batchwire inspect {report.path}" in err


def test_a_missing_source_is_said_to_be_missing(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "my-images"
    assert main(["ingest", str(missing), str(tmp_path / "out"), "--name", "pets"]) == 2
    assert capsys.readouterr().err.strip() == f"error: source {missing} does not exist"
