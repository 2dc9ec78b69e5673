"""A mixed batch's records: read from several real LMDB datasets by mixed ids, in the
batch's order, byte for byte what each source holds, with a bad record left out by its
mixed id."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
from test_corrupt import corrupt, truncated

from batchwire.common.mixture import mixture_counts, mixture_order
from batchwire.server.data import Dataset, ingest, write_image_folders
from batchwire.server.data.records import MixedDataset


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[pathlib.Path]:
    """Two datasets of different sizes and classes (40 and 12 samples)."""
    root = tmp_path_factory.mktemp("mixed")
    made = []
    for name, per_class, seed in (("large", 10, 3), ("small", 3, 4)):
        write_image_folders(root / f"{name}-images", per_class=per_class, size=32, seed=seed)
        ingest(root / f"{name}-images", root / "datasets", name=name, shard_size=16)
        made.append(root / "datasets" / name)
    return made


def test_a_mixed_batch_is_each_sources_records_in_the_batchs_order(
    sources: list[pathlib.Path],
) -> None:
    with Dataset(sources[0]) as large, Dataset(sources[1]) as small:
        mixed = MixedDataset([large, small])
        assert mixed.num_samples == 52 and mixed.sizes == (40, 12)
        counts = mixture_counts(mixed.sizes, weights=(0.5, 0.5), length=64)  # small: upsampled
        batch = mixture_order(9, 0, mixed.sizes, counts)[:48]
        assert len(set(batch[batch >= 40].tolist())) < np.count_nonzero(batch >= 40)  # repeats
        ids, images, labels, skipped = mixed.read_screened(batch)
        assert ids.tolist() == batch.tolist() and skipped == []
        for mixed_id, image, label in zip(ids.tolist(), images, labels.tolist(), strict=True):
            source, sample = (large, mixed_id) if mixed_id < 40 else (small, mixed_id - 40)
            (expected,), (expected_label,) = source.read([sample])
            assert expected is not None and image.tobytes() == expected.tobytes()
            assert label == expected_label  # the source's own class


def test_a_bad_record_of_one_source_is_left_out_by_its_mixed_id(
    sources: list[pathlib.Path], tmp_path: pathlib.Path
) -> None:
    shutil.copytree(sources[1], tmp_path / "small")
    corrupt(tmp_path / "small", {5: truncated(tmp_path / "small", 5)})
    with Dataset(sources[0]) as large, Dataset(tmp_path / "small") as small:
        mixed = MixedDataset([large, small])
        batch = np.array([45, 3, 40 + 5, 44, 0], dtype=np.int64)  # 45 is small's sample 5, twice
        ids, images, labels, skipped = mixed.read_screened(batch)
        assert ids.tolist() == [3, 44, 0] and len(images) == len(labels) == 3
        assert skipped == [45, 45]
