"""The datasets a server serves: found under its data directory, rescanned, lent to streams.

A :class:`Catalog` maps names to open :class:`Dataset` objects. :meth:`Catalog.scan` looks at
the data directory again and applies what changed: a new directory is opened, one whose
manifest changed (``ingest --overwrite``) is opened again and takes the name over, one that
is gone leaves the catalog. A stream borrows its dataset (:meth:`Catalog.acquire`) and gives
it back when it ends (:meth:`Catalog.release`); a dataset that left the catalog is closed
once the last stream that borrowed it gives it back, so a stream always ends on the version
it started with.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading

from batchwire.common.stream import NAME_PATTERN
from batchwire.server.data.records import MANIFEST, Dataset, manifest_version
from batchwire.server.errors import DatasetError, InvalidRequest, NotFound, VersionMismatch
from batchwire.server.pipelines import PipelineSpec

__all__ = [
    "Catalog",
    "Change",
    "DatasetDescription",
    "check_data_dir",
    "check_inputs",
    "check_version",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DatasetDescription:
    """A served dataset, as ``DescribeDataset`` reports it."""

    name: str
    num_samples: int
    classes: tuple[str, ...]
    format_version: int
    version: str  # of the content: see batchwire.server.data.manifest_version


@dataclasses.dataclass(frozen=True)
class Change:
    """One dataset that a scan added, replaced or removed (``change``), with its versions
    before (``old``, empty when added) and after (``new``, empty when removed), and its
    samples after (0 when removed)."""

    name: str
    change: str  # "added", "replaced" or "removed"
    old: str = ""
    new: str = ""
    num_samples: int = 0


def check_data_dir(root: pathlib.Path) -> None:
    """``DatasetError`` unless ``root`` is a directory that holds datasets by name."""
    if not root.is_dir():
        raise DatasetError(f"data directory {root} does not exist or is not a directory")
    if (root / MANIFEST).is_file():
        raise DatasetError(
            f"data directory {root} is itself a dataset (it holds manifest.json): point "
            f"--data-dir at the directory that holds datasets by name, here {root.parent}, "
            f"and clients ask for dataset {root.name!r}"
        )


class Catalog:
    """Datasets by name, with the streams that borrow them counted. Thread-safe."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._serving: dict[str, Dataset] = {}
        # Borrowers of every open Dataset, by id: those that left the catalog included.
        self._users: dict[int, int] = {}
        self._retired: dict[int, Dataset] = {}
        # A directory that failed to open is tried again only once its manifest changes.
        self._failed: dict[str, str] = {}
        self._scan_lock = threading.Lock()  # one scan at a time

    # -- lending -----------------------------------------------------------------------

    def acquire(self, name: str) -> Dataset:
        """The dataset served as ``name`` now, borrowed until :meth:`release`; NotFound."""
        with self._lock:
            dataset = self._served_as(name)
            self._users[id(dataset)] = self._users.get(id(dataset), 0) + 1
            return dataset

    def release(self, dataset: Dataset) -> None:
        """Give back a dataset from :meth:`acquire`; closes it if it left the catalog and
        this was its last borrower."""
        with self._lock:
            users = self._users.get(id(dataset), 0) - 1
            if users > 0:
                self._users[id(dataset)] = users
                return
            self._users.pop(id(dataset), None)
            retired = self._retired.pop(id(dataset), None)
        if retired is not None:
            retired.close()
            log.debug(
                "dataset %r version %s closed: its last stream ended", retired.name, retired.version
            )

    def get(self, name: str) -> Dataset:
        """The dataset served as ``name`` now, not borrowed (for its facts); NotFound."""
        with self._lock:
            return self._served_as(name)

    def _served_as(self, name: str) -> Dataset:
        """The dataset served as ``name`` (under the lock); NotFound naming the others."""
        dataset = self._serving.get(name)
        if dataset is None:
            known = ", ".join(sorted(self._serving)) or "none"
            raise NotFound(f"no dataset named {name!r} on this server (it has: {known})")
        return dataset

    def describe(self, name: str) -> DatasetDescription:
        """Dataset ``name`` as ``DescribeDataset`` reports it (NotFound if not served)."""
        dataset = self.get(name)
        return DatasetDescription(
            name=name,
            num_samples=dataset.num_samples,
            classes=dataset.classes,
            format_version=dataset.manifest.format_version,
            version=dataset.version,
        )

    def describe_all(self) -> list[DatasetDescription]:
        """Every dataset served now, described."""
        described = []
        for name in self.names():
            try:
                described.append(self.describe(name))
            except NotFound:
                continue  # removed by a rescan meanwhile
        return described

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._serving)

    def __len__(self) -> int:
        with self._lock:
            return len(self._serving)

    # -- scanning ----------------------------------------------------------------------

    def scan(self) -> list[Change]:
        """Look at the data directory again and serve what is there now; the changes.

        ``DatasetError`` if the data directory itself is missing or is a dataset (nothing
        changes then). A dataset that cannot be opened is logged and left out (a replaced
        one keeps its old version until its new one opens).
        """
        with self._scan_lock:
            check_data_dir(self.root)
            found = self._directories()
            changes: list[Change] = []
            current = {name: d.version for name, d in self.snapshot().items()}
            for name, directory in found.items():
                version = _version_of(directory)
                if version is None or version == current.get(name):
                    continue
                if self._failed.get(name) == version:
                    continue  # logged already; tried again once the manifest changes
                try:
                    dataset = Dataset(directory)
                except DatasetError as exc:
                    self._failed[name] = version
                    log.error("cannot serve dataset %s: %s", directory, exc)
                    continue
                self._failed.pop(name, None)
                old = self._put(name, dataset)
                kind = "added" if old is None else "replaced"
                changes.append(Change(name, kind, old or "", dataset.version, dataset.num_samples))
            for name in sorted(set(current) - set(found)):
                old = self._put(name, None)
                changes.append(Change(name, "removed", old or ""))
            for name in set(self._failed) - set(found):
                del self._failed[name]
            return changes

    def _directories(self) -> dict[str, pathlib.Path]:
        found: dict[str, pathlib.Path] = {}
        try:
            children = sorted(self.root.iterdir())
        except OSError as exc:
            raise DatasetError(f"cannot list data directory {self.root}: {exc.strerror}") from exc
        for child in children:
            # Hidden: an ingest in progress, or an old version being removed.
            if child.name.startswith(".") or not (child / MANIFEST).is_file():
                continue
            if not NAME_PATTERN.match(child.name):
                log.warning("ignoring dataset directory %s: its name is not allowed", child)
                continue
            found[child.name] = child
        return found

    def snapshot(self) -> dict[str, Dataset]:
        """The datasets served now, by name (not borrowed: for their facts)."""
        with self._lock:
            return dict(self._serving)

    def _put(self, name: str, dataset: Dataset | None) -> str | None:
        """Serve ``dataset`` as ``name`` (None: stop serving ``name``); the version it
        took over from, or None. The old Dataset closes now if no stream borrows it,
        else with its last stream."""
        with self._lock:
            old = self._serving.pop(name, None)
            if dataset is not None:
                self._serving[name] = dataset
            if old is None:
                return None
            borrowed = self._users.get(id(old), 0) > 0
            if borrowed:
                self._retired[id(old)] = old
        if not borrowed:
            old.close()
        return old.version

    def close(self) -> None:
        """Close every dataset, borrowed or not (the server is stopping)."""
        with self._lock:
            datasets = [*self._serving.values(), *self._retired.values()]
            self._serving.clear()
            self._retired.clear()
            self._users.clear()
        for dataset in datasets:
            dataset.close()


def _version_of(directory: pathlib.Path) -> str | None:
    """The version of the manifest in ``directory`` now, or None if it cannot be read."""
    try:
        return manifest_version((directory / MANIFEST).read_bytes())
    except OSError:
        return None


def check_version(name: str, expected: str, dataset: Dataset) -> None:
    """VersionMismatch if a stream of dataset ``name`` expects another version of it (a
    client resuming a stream after the dataset was replaced); an empty expectation (older
    clients) is not checked."""
    if expected and expected != dataset.version:
        raise VersionMismatch(
            f"the stream expects version {expected} of dataset "
            f"{name!r} but this server serves version {dataset.version}: the "
            "dataset was replaced (re-ingested). Resuming would mix samples of both "
            "versions; start the epoch again (a new loader, or set_epoch) or serve the "
            "old version"
        )


def check_inputs(pipeline: PipelineSpec, dataset: Dataset) -> None:
    """InvalidRequest, before any stream, if ``pipeline`` takes a field that ``dataset``
    lacks or holds as another kind: it names both, and the dataset's fields."""
    fields = {spec.name: spec.kind for spec in dataset.manifest.fields}
    for needed in pipeline.inputs:
        if fields.get(needed.name) == needed.kind:
            continue
        has = ", ".join(f"{name} ({kind})" for name, kind in fields.items()) or "none"
        found = f"holds it as {fields[needed.name]}" if needed.name in fields else "lacks it"
        raise InvalidRequest(
            f"pipeline {pipeline.name!r} takes the field {needed.name!r} ({needed.kind}) of each "
            f"sample, and dataset {dataset.name!r} {found} (its fields: {has}). Choose a "
            "pipeline of images alone (val, train, multicrop), or a dataset ingested with "
            f"{needed.name} (docs/datasets.md)"
        )
