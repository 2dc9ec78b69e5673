"""``batchwire ingest`` of samples with fields: COCO, JSON lines, CSV and WebDataset folders and
``.tar`` shards, on real images, real DALI and real LMDB; each record's fields read back
exactly, bad annotations are reported and left out, and ``inspect`` lists the fields."""

from __future__ import annotations

import io
import json
import pathlib
import tarfile

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("nvidia.dali")

from batchwire.cli import main
from batchwire.cli._ingest import FORMATS as CLI_FORMATS
from batchwire.server.data import (
    BOX_COLOURS,
    FORMATS,
    Dataset,
    IngestReport,
    Manifest,
    ingest,
    write_coco_boxes,
)


def png(colour: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    encoded = io.BytesIO()
    Image.new("RGB", size, colour).save(encoded, "PNG")
    return encoded.getvalue()


def reasons(report: IngestReport) -> dict[tuple[str, str], str]:
    return {(r.path, r.part): r.reason for r in report.rejected}


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_coco_boxes(tmp_path_factory.mktemp("coco"), count=12, seed=3)


def test_coco_boxes_and_categories_read_back_exactly(
    coco: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    report = ingest(coco, tmp_path, name="boxes", images=coco.parent / "images", shard_size=5)
    body = json.loads(coco.read_text())
    assert report.rejected == ()
    ids = sorted(BOX_COLOURS)
    with Dataset(report.path) as dataset:
        manifest = dataset.manifest
        assert manifest.classes == tuple(BOX_COLOURS[i][0] for i in ids)
        assert manifest.class_ids == tuple(ids)
        schema = {s.name: (s.kind, s.dtype, s.shape, s.format, s.along) for s in manifest.fields}
        assert schema == {
            "image_id": ("int", "int64", (), "", ""),
            "boxes": ("float", "float32", (-1, 4), "ltrb", ""),
            "labels": ("int", "int64", (-1,), "class", "boxes"),
            "iscrowd": ("int", "int64", (-1,), "", "boxes"),
        }
        boxes_spec = manifest.fields[1]
        assert boxes_spec.count_total == len(body["annotations"])
        # A detection dataset's class counts are its boxes per class.
        assert list(manifest.class_counts) == [
            sum(a["category_id"] == i for a in body["annotations"]) for i in ids
        ]
        fields = dataset.fields(range(dataset.num_samples))
        images, labels = dataset.read(range(dataset.num_samples))
    assert set(labels.tolist()) == {-1}  # no image-level class
    for image, sample, record in zip(body["images"], fields, images, strict=True):
        assert int(sample["image_id"]) == image["id"]
        mine = [a for a in body["annotations"] if a["image_id"] == image["id"]]
        want = np.array([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in mine)])
        np.testing.assert_array_equal(sample["boxes"], want.astype(np.float32))
        assert sample["labels"].tolist() == [ids.index(a["category_id"]) for a in mine]
        assert sample["iscrowd"].tolist() == [0] * len(mine)
        # Each box lies over its category's colour, in the stored image.
        assert record is not None
        pixels = np.asarray(Image.open(io.BytesIO(record.tobytes())).convert("RGB"))
        for (left, top, right, bottom), label in zip(
            sample["boxes"].astype(int), sample["labels"], strict=True
        ):
            under = pixels[top:bottom, left:right].reshape(-1, 3)
            assert (under == BOX_COLOURS[ids[label]][1]).all()


def test_bad_coco_annotations_are_reported_and_the_rest_ingested(
    coco: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A box outside its image or of no area is dropped with its class, an annotation of an
    unknown category is left out, an image that cannot be read is rejected: each with its
    reason; the rest of each sample, and every other sample, is ingested."""
    body = json.loads(coco.read_text())
    first, second = body["images"][0], body["images"][1]
    width, height = first["width"], first["height"]
    extra = [
        {"id": 901, "image_id": first["id"], "category_id": 1, "bbox": [width - 5, 2, 30, 10]},
        {"id": 902, "image_id": first["id"], "category_id": 3, "bbox": [5, 5, 0, 10]},
        {"id": 903, "image_id": first["id"], "category_id": 99, "bbox": [5, 5, 10, 10]},
        {"id": 904, "image_id": first["id"], "category_id": 1, "bbox": [-0.5, 0, 10, 10]},
    ]
    kept_before = [a for a in body["annotations"] if a["image_id"] == first["id"]]
    body["annotations"] += extra
    body["images"].append({"id": 5, "file_name": "missing.png", "width": 10, "height": 10})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(body))
    report = ingest(bad, tmp_path / "out", name="bad", images=coco.parent / "images")
    assert report.num_samples == len(body["images"]) - 1
    got = reasons(report)
    name = first["file_name"]
    assert got[(name, "boxes " + str(len(kept_before)))].startswith(
        f"box [{width - 5:g}, 2, {width + 25:g}, 12] (ltrb) lies outside the {width}x{height}"
    )
    assert got[(name, "boxes " + str(len(kept_before) + 1))].endswith(
        "has no area; the box was dropped"
    )
    assert got[(name, "annotation 903")] == "category 99 is not in categories"
    assert got[("missing.png", "")].startswith("cannot read")
    assert len(got) == 4
    with Dataset(report.path) as dataset:
        sample = dataset.fields([0])[0]
        rejected = Manifest.load(report.path).rejected
    # The kept boxes: the first image's own, and 904 clipped into the image (0.5 px out).
    assert len(sample["boxes"]) == len(sample["labels"]) == len(kept_before) + 1
    np.testing.assert_array_equal(sample["boxes"][-1], [0, 0, 9.5, 10])
    assert {"path": name, "reason": got[(name, "annotation 903")], "part": "annotation 903"} in (
        rejected
    )
    assert second["file_name"] not in {path for path, _ in got}


def test_coco_captions_and_a_caption_that_is_not_text(
    coco: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    body = json.loads((coco.parent / "captions.json").read_text())
    body["annotations"].append({"id": 999, "image_id": body["images"][0]["id"], "caption": 7})
    path = tmp_path / "captions.json"
    path.write_text(json.dumps(body))
    report = ingest(path, tmp_path / "out", name="captions", images=coco.parent / "images")
    assert reasons(report) == {
        (body["images"][0]["file_name"], "annotation 999"): "caption 7 is not text"
    }
    with Dataset(report.path) as dataset:
        (spec,) = [s for s in dataset.manifest.fields if s.name == "caption"]
        assert (spec.kind, spec.shape, spec.count_min, spec.count_max) == ("text", (-1,), 1, 2)
        fields = dataset.fields(range(dataset.num_samples))
    for image, sample in zip(body["images"], fields, strict=True):
        want = [
            a["caption"]
            for a in body["annotations"]
            if a["image_id"] == image["id"] and isinstance(a["caption"], str)
        ]
        assert sample["caption"] == tuple(want)


def write_images(root: pathlib.Path, count: int) -> list[bytes]:
    root.mkdir(parents=True, exist_ok=True)
    images = [png((20 * i, 100, 200 - 10 * i)) for i in range(count)]
    for i, data in enumerate(images):
        (root / f"{i}.png").write_bytes(data)
    return images


ROWS = [
    {
        "path": "img/0.png",
        "label": "cat",
        "caption": "a cat",
        "score": 0.5,
        "vector": [1, 0, 1],
        "tags": ["x", "y"],
    },
    {
        "path": "img/1.png",
        "label": "dog",
        "caption": "a dog",
        "score": 2,
        "vector": [0, 1, 1],
        "tags": ["z"],
    },
    {"path": "img/2.png", "label": "cat", "caption": 5, "score": 1.0, "vector": [0, 0, 1]},
    {"path": "img/3.png", "label": "dog", "caption": "no file", "score": 1.0, "vector": [1, 1, 1]},
    {"path": "img/4.png", "caption": "unlabelled", "score": 3.25, "vector": [1, 1, 0], "tags": []},
]


def check_table(report: IngestReport, images: list[bytes]) -> None:
    assert reasons(report) == {
        ("img/2.png", ""): "field 'caption' is int 5, not text like the rest of its column",
        ("img/3.png", ""): "cannot read: No such file or directory",
    }
    with Dataset(report.path) as dataset:
        manifest = dataset.manifest
        assert manifest.classes == ("cat", "dog")
        assert manifest.class_counts == (1, 1)
        schema = {s.name: (s.kind, s.shape) for s in manifest.fields}
        assert schema == {
            "caption": ("text", ()),
            "score": ("float", ()),
            "vector": ("int", (3,)),
            "tags": ("text", (-1,)),
        }
        read, labels = dataset.read([0, 1, 2])
        fields = dataset.fields([0, 1, 2])
    assert [r.tobytes() for r in read if r is not None] == [images[0], images[1], images[4]]
    assert labels.tolist() == [0, 1, -1]
    assert [f["caption"] for f in fields] == ["a cat", "a dog", "unlabelled"]
    assert [float(f["score"]) for f in fields] == [0.5, 2.0, 3.25]
    assert [f["vector"].tolist() for f in fields] == [[1, 0, 1], [0, 1, 1], [1, 1, 0]]
    assert [f["tags"] for f in fields] == [("x", "y"), ("z",), ()]


def test_jsonl_manifest(tmp_path: pathlib.Path) -> None:
    images = write_images(tmp_path / "src" / "img", 5)
    (tmp_path / "src" / "img" / "3.png").unlink()
    manifest = tmp_path / "src" / "train.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    check_table(ingest(manifest, tmp_path / "out", name="table"), images)


def test_csv_manifest_keeps_numeric_looking_text_as_text(tmp_path: pathlib.Path) -> None:
    """A CSV cell is text where its column is text ("5" stays a caption), a number or a list
    where it parses as one; a cell of text in a column of numbers rejects its row."""
    images = write_images(tmp_path / "pictures" / "img", 5)
    (tmp_path / "pictures" / "img" / "3.png").unlink()
    lines = ["path,label,caption,score,vector,tags"]
    for row in ROWS:
        tags = json.dumps(row["tags"]).replace('"', '""') if "tags" in row else ""
        cells = [
            str(row["path"]),
            str(row.get("label", "")),
            str(row["caption"]),
            str(row["score"]),
            '"' + json.dumps(row["vector"]) + '"',
            f'"{tags}"' if tags else "",
        ]
        lines.append(",".join(cells))
    lines.append('img/1.png,dog,a dog again,high,"[1, 1, 1]",')
    manifest = tmp_path / "meta" / "train.csv"
    manifest.parent.mkdir()
    manifest.write_text("\n".join(lines) + "\n")
    report = ingest(manifest, tmp_path / "out", name="table", images=tmp_path / "pictures")
    assert reasons(report) == {
        ("img/1.png", ""): "field 'score' is str 'high', not float like the rest of its column",
        ("img/3.png", ""): "cannot read: No such file or directory",
    }
    with Dataset(report.path) as dataset:
        assert dataset.manifest.classes == ("cat", "dog")
        schema = {s.name: (s.kind, s.shape) for s in dataset.manifest.fields}
        assert schema == {
            "caption": ("text", ()),
            "score": ("float", ()),
            "vector": ("int", (3,)),
            "tags": ("text", (-1,)),
        }
        read, labels = dataset.read(range(4))
        fields = dataset.fields(range(4))
    assert [r.tobytes() for r in read if r is not None] == [images[i] for i in (0, 1, 2, 4)]
    assert labels.tolist() == [0, 1, 0, -1]
    assert [f["caption"] for f in fields] == ["a cat", "a dog", "5", "unlabelled"]
    assert [float(f["score"]) for f in fields] == [0.5, 2.0, 1.0, 3.25]
    assert [f["vector"].tolist() for f in fields] == [[1, 0, 1], [0, 1, 1], [0, 0, 1], [1, 1, 0]]
    assert [f.get("tags") for f in fields] == [("x", "y"), ("z",), None, ()]


def webdataset_files(count: int) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for i in range(count):
        key = f"part/{i:04d}"
        files[f"{key}.png"] = png((30 * i, 60, 90))
        files[f"{key}.json"] = json.dumps({"boxes": [[1, 2, 3, 4]] * i, "id": i}).encode()
        files[f"{key}.txt"] = f"sample {i}\n".encode()
        files[f"{key}.cls"] = str(i % 2).encode()
    files["part/0002.txt"] = b"\xff\xfe not utf-8"
    files["part/0009.json"] = b"{}"  # no image for key 0009
    files["README.md"] = b"not a sample"
    return files


def check_webdataset(report: IngestReport, files: dict[str, bytes], prefix: str) -> None:
    assert reasons(report) == {
        (f"{prefix}part/0002.png", ""): ".txt is not UTF-8 text",
        (f"{prefix}part/0009", ""): "no .jpg, .jpeg or .png image for this key",
    }
    with Dataset(report.path) as dataset:
        assert dataset.manifest.classes == ("0", "1")
        schema = {s.name: (s.kind, s.shape) for s in dataset.manifest.fields}
        assert schema == {"boxes": ("int", (-1, 4)), "id": ("int", ()), "caption": ("text", ())}
        read, labels = dataset.read(range(3))
        fields = dataset.fields(range(3))
    for sample, image, label, i in zip(fields, read, labels, (0, 1, 3), strict=True):
        assert image is not None and image.tobytes() == files[f"part/{i:04d}.png"]
        assert label == i % 2
        assert sample["caption"] == f"sample {i}"
        assert int(sample["id"]) == i
        assert sample["boxes"].shape == (i, 4)
        assert sample["boxes"].tolist() == [[1, 2, 3, 4]] * i


def test_webdataset_folder(tmp_path: pathlib.Path) -> None:
    files = webdataset_files(4)
    for name, data in files.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_bytes(data)
    report = ingest(tmp_path / "src", tmp_path / "out", name="wds", source_format="webdataset")
    check_webdataset(report, files, "")


def test_webdataset_tar_told_from_its_name(tmp_path: pathlib.Path) -> None:
    files = webdataset_files(4)
    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w") as archive:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    check_webdataset(ingest(shard, tmp_path / "out", name="wds"), files, "")


def test_webdataset_folder_of_shards_whose_keys_lie_at_their_roots(tmp_path: pathlib.Path) -> None:
    """Several shards of ``key.png`` and its sidecars at each tar's root (as WebDataset's
    writers make them): each shard's samples, keyed within their shard."""
    files = webdataset_files(4)
    (tmp_path / "src").mkdir()
    first = sorted(name for name in files if name.startswith(("part/0000", "part/0001")))
    for shard, names in enumerate((first, sorted(files.keys() - set(first)))):
        with tarfile.open(tmp_path / "src" / f"shard-{shard:03d}.tar", "w") as archive:
            for name in names:
                info = tarfile.TarInfo(name.removeprefix("part/"))
                info.size = len(files[name])
                archive.addfile(info, io.BytesIO(files[name]))
    report = ingest(tmp_path / "src", tmp_path / "out", name="wds")
    assert report.num_samples == 3  # 0000, 0001 and 0003 (0002's .txt is not UTF-8)
    assert sorted(r.reason for r in report.rejected) == [
        ".txt is not UTF-8 text",
        "no .jpg, .jpeg or .png image for this key",
    ]
    with Dataset(report.path) as dataset:
        captions = sorted(sample["caption"] for sample in dataset.fields(range(3)))
    assert captions == ["sample 0", "sample 1", "sample 3"]


def test_the_command_ingests_and_inspect_lists_the_fields(
    coco: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["ingest", str(coco), str(tmp_path), "--name", "boxes", "--no-progress"]
    assert main([*args, "--images", str(coco.parent / "images"), "--format", "coco"]) == 0
    ingested = capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "boxes")]) == 0
    inspected = capsys.readouterr().out
    spec = Manifest.load(tmp_path / "boxes").fields[1]
    line = (
        f"  boxes          float  float32  [-1, 4]    format ltrb  in 12 samples, "
        f"{spec.count_min}..{spec.count_max} each (mean {spec.count_mean:.2f})"
    )
    for out in (ingested, inspected):
        assert "fields    4\n" in out
        assert line in out.splitlines()
        assert "  labels         int    int64    [-1]       format class  along boxes" in out
    assert "ingested 12 images in 3 classes" in ingested


def test_the_command_says_what_is_wrong_with_a_source(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "not-coco.json").write_text('{"images": 3}')
    argv = ["ingest", str(tmp_path / "not-coco.json"), str(tmp_path / "out"), "--name", "x"]
    assert main(argv) == 2
    assert "is not a COCO annotation file" in capsys.readouterr().err
    (tmp_path / "rows.jsonl").write_text('{"label": 1}\n')
    argv = ["ingest", str(tmp_path / "rows.jsonl"), str(tmp_path / "out"), "--name", "x"]
    assert main(argv) == 2
    assert "every row needs a 'path'" in capsys.readouterr().err


def test_the_commands_formats_are_ingests() -> None:
    assert CLI_FORMATS == FORMATS
