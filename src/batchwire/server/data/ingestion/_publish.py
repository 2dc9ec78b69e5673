"""Publishing a dataset atomically: a complete directory renamed into place.

The new dataset is written to a hidden directory beside its final place; it is
renamed to ``OUT/NAME`` only once complete, and an old dataset there is removed
only after the new one is in.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import shutil

from batchwire.server.data.records import MANIFEST
from batchwire.server.errors import IngestError

__all__ = ["check_replaceable", "new_dir", "publish"]


def check_replaceable(final: pathlib.Path, overwrite: bool) -> None:
    """Refuse (``IngestError``) to replace ``final`` unless it is absent or an empty
    directory, or ``overwrite`` is given and it is a batchwire dataset."""
    if not (final.exists() or final.is_symlink()):
        return
    if final.is_dir() and not final.is_symlink() and not any(final.iterdir()):
        return  # an empty directory is replaced without asking
    if not overwrite:
        raise IngestError(
            f"{final} already exists: pass --overwrite to replace it, or choose another --name"
        )
    if not (final.is_dir() and (final / MANIFEST).is_file()):
        raise IngestError(
            f"{final} exists and is not a batchwire dataset (no {MANIFEST}); "
            "refusing to replace it: remove it yourself or choose another --name"
        )


def publish(partial: pathlib.Path, final: pathlib.Path, overwrite: bool) -> None:
    """Rename the complete dataset into place; an old one goes only after the new one is in."""
    check_replaceable(final, overwrite)
    if final.exists():
        old = new_dir(final.parent, f".{final.name}.old-")
        os.replace(final, old)  # onto an empty directory: allowed by rename(2)
        try:
            os.replace(partial, final)
        except BaseException:
            os.replace(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            os.rename(partial, final)
        except OSError as exc:
            raise IngestError(f"cannot move the new dataset into {final}: {exc.strerror}") from exc
    _fsync_dir(final.parent)


def new_dir(parent: pathlib.Path, prefix: str) -> pathlib.Path:
    """A new empty directory ``parent/<prefix><random hex>``."""
    # Not tempfile.mkdtemp: its 0700 mode would stick to the published dataset
    # and lock out a server running as another user; mkdir honours the umask.
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
