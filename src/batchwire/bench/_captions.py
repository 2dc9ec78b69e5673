"""The image-text data of ``bench --compare``'s ``captions`` row, built once in
:func:`~batchwire.bench.cache_dir`: WebDataset ``.tar`` shards of generated photos, each
``key.jpg`` with its caption as ``key.txt``, beside DALI's index of each shard (``.idx``,
as DALI's ``wds2idx`` writes it), which ``fn.readers.webdataset`` reads; and the same
shards ingested, which a server serves.

The photos are :func:`~batchwire.bench.bench_dataset`'s (500x375 JPEG, the same seed: the
same pictures as the ``train`` and ``multicrop`` rows), so that decoding weighs in the
``captions`` row as it does in theirs. Their captions are a sentence or two, 26 to 158
bytes.
"""

from __future__ import annotations

import io
import pathlib
import shutil
import sys
import tarfile
import tempfile

import numpy as np

from batchwire.bench._runs import cache_dir

__all__ = ["bench_captions", "caption", "write_caption_shards"]

SHARDS = 8  # shards of a generated image-text dataset

_SUBJECTS = (
    "a dog",
    "two children",
    "an old red bicycle",
    "a woman in a yellow coat",
    "a flock of pigeons",
    "a small wooden boat",
    "a man carrying a surfboard",
    "three cups of coffee",
    "a cat",
    "a city bus",
)
_ACTIONS = ("resting", "standing", "waiting", "half hidden", "seen from above", "lit by the sun")
_PLACES = (
    "on a wooden bench",
    "beside a river",
    "in a crowded market street",
    "under a tree",
    "at the edge of a quiet harbour",
    "on a kitchen table",
    "in the snow",
    "near a brick wall covered in ivy",
)
_DETAILS = (
    "The light is soft.",
    "Clouds gather over the hills behind, and the colours are muted.",
    "A few people walk past without looking.",
    "The picture is slightly blurred at the edges.",
    "Behind it, a row of parked cars stretches towards a church tower in the distance.",
)


def caption(rng: np.random.Generator) -> str:
    """A caption of a sentence or two, its length varying from 26 to 158 bytes."""
    subject, action, place = (str(rng.choice(words)) for words in (_SUBJECTS, _ACTIONS, _PLACES))
    first = f"{subject[0].upper()}{subject[1:]} {action} {place}."
    return first if rng.random() < 0.5 else f"{first} {rng.choice(_DETAILS)}"


def write_caption_shards(
    photos: list[pathlib.Path], out: pathlib.Path, shards: int, *, seed: int = 0
) -> list[pathlib.Path]:
    """``photos`` in ``shards`` uncompressed ``.tar`` shards in ``out`` (in order, a run
    each), each photo as ``key.jpg`` beside its :func:`caption` as ``key.txt``, and each
    shard's DALI index (``.idx``); returns the shards. Keys are the photos' names, at
    each shard's root, as WebDataset's writers lay them out."""
    from wds2idx import IndexCreator  # DALI's own tool, installed with DALI

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for shard in range(shards):
        path = out / f"captions-{shard:03d}.tar"
        with tarfile.open(path, "w") as archive:
            for photo in photos[
                shard * len(photos) // shards : (shard + 1) * len(photos) // shards
            ]:
                key = photo.stem
                for extension, data in (
                    ("jpg", photo.read_bytes()),
                    ("txt", caption(rng).encode("utf-8")),
                ):
                    info = tarfile.TarInfo(f"{key}.{extension}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
        index = IndexCreator(str(path), str(path.with_suffix(".idx")), verbose=False)
        index.create_index()
        index.close()
        paths.append(path)
    return paths


def bench_captions(images: int, *, progress: bool = True) -> tuple[pathlib.Path, pathlib.Path, str]:
    """``images`` generated photos with captions, built once in :func:`cache_dir`: the
    folder of their WebDataset shards and DALI indexes (:func:`write_caption_shards`), and
    the data directory and name of the same shards ingested."""
    from tqdm import tqdm

    from batchwire.server.data import ingest, write_photo_folders

    name = f"captions-{images}"
    shards = cache_dir() / "captions" / name
    data_dir = cache_dir() / "datasets"
    # The ingest comes last: a manifest says that the shards were written whole.
    if not (data_dir / name / "manifest.json").is_file():
        print(
            f"generating {images} photos with captions into {shards}, once",
            file=sys.stderr,
            flush=True,
        )
        shutil.rmtree(shards, ignore_errors=True)
        data_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="batchwire-bench-", dir=data_dir.parent) as tmp:
            folders = pathlib.Path(tmp)
            show = None if progress else True  # None: off where stderr is no terminal
            with tqdm(total=images, desc="generating photos", unit="img", disable=show) as bar:
                write_photo_folders(folders, count=images, on_image=lambda: bar.update())
            photos = sorted(folders.rglob("*.jpg"), key=lambda p: p.name)
            write_caption_shards(photos, shards, min(SHARDS, images))
        ingest(shards, data_dir, name=name, overwrite=True, progress=progress)
    return shards, data_dir, name
