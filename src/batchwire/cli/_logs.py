"""Log output of the ``batchwire`` command: plain lines for people, JSON lines for machines.

``--log-format json`` (or ``BATCHWIRE_LOG_FORMAT=json``) writes one JSON object per
line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, then every field
the code passed with ``extra=`` (for example the stream start and end lines carry
``event``, ``peer``, ``dataset``, ``pipeline``, ``rank``, ``samples``, ``duration_s``),
and ``exception`` with the traceback when there is one.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "FORMATS",
    "LEVELS",
    "JsonFormatter",
    "choose",
    "configure",
    "configure_worker",
    "real_output_for_children",
]

FORMATS = ("plain", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PLAIN_WORKER = "%(asctime)s %(levelname)s %(name)s [worker %(worker)s]: %(message)s"

# With JSON logs: (the real stdout, the real stderr, the pipe C output is sent to),
# as file descriptors; see real_output_for_children.
_captured: tuple[int, int, int] | None = None

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it (anything unknown as its ``str``)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line, with the record's ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_") and key not in entry:
                entry[key] = _plain(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


def choose(
    level: str | None, fmt: str | None, environ: Mapping[str, str], default_level: str = "INFO"
) -> tuple[str, str]:
    """The log level and format: the flags, else ``BATCHWIRE_LOG_LEVEL`` and
    ``BATCHWIRE_LOG_FORMAT``, else ``default_level`` and plain."""
    return (
        level or environ.get("BATCHWIRE_LOG_LEVEL", "").strip().upper() or default_level,
        fmt or environ.get("BATCHWIRE_LOG_FORMAT", "").strip().lower() or "plain",
    )


class _WorkerField(logging.Filter):
    """Adds ``worker`` (its index) to every record: a JSON field, a plain-text tag."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.index
        return True


def configure_worker(level: str, fmt: str, index: int) -> None:
    """:func:`configure` in worker process ``index`` of ``batchwire serve --workers``:
    its records say which worker wrote them."""
    configure(level, fmt, worker=index)


def configure(level: str, fmt: str, *, worker: int | None = None) -> None:
    """Send log records of ``level`` and above to stderr in ``fmt`` (plain|json),
    tagged with ``worker`` where given.

    Like ``logging.basicConfig``, does nothing when the root logger already has
    handlers (an embedding application or a test runner configured logging)."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {LEVELS}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    if logging.getLogger().handlers:
        return
    if fmt == "json":
        _capture_native_output()
    handler = logging.StreamHandler(sys.stderr)
    plain = PLAIN if worker is None else PLAIN_WORKER
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(plain))
    if worker is not None:
        handler.addFilter(_WorkerField(worker))
    logging.basicConfig(level=level, handlers=[handler])


@contextlib.contextmanager
def real_output_for_children() -> Iterator[None]:
    """While open, file descriptors 1 and 2 are the real stdout and stderr again, so
    processes started now inherit those (and, logging JSON, capture their own C output)
    instead of this process's capture pipe, which would wrap their JSON lines in its
    own records. Nothing of this process should write C output meanwhile."""
    if _captured is None:
        yield
        return
    out, err, pipe = _captured
    os.dup2(out, 1)
    os.dup2(err, 2)
    try:
        yield
    finally:
        os.dup2(pipe, 1)
        os.dup2(pipe, 2)


def _capture_native_output() -> None:
    """Make what C libraries write straight to file descriptors 1 and 2 (libjpeg's and
    libpng's warnings from DALI's decoders, gRPC core) log records of
    ``batchwire.native``, so that every line of a JSON log is JSON. Python's own
    ``sys.stdout`` and ``sys.stderr`` keep writing where they did."""
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout = os.fdopen(os.dup(1), "w", buffering=1, encoding=sys.stdout.encoding)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding)
    global _captured
    read, write = os.pipe()
    os.dup2(write, 1)
    os.dup2(write, 2)
    # The write end stays open for real_output_for_children to restore.
    _captured = (sys.stdout.fileno(), sys.stderr.fileno(), write)
    native = logging.getLogger("batchwire.native")

    def forward() -> None:
        with os.fdopen(read, "r", errors="replace") as lines:
            for line in lines:
                if line.strip():
                    native.warning("%s", line.rstrip("\n"))

    threading.Thread(target=forward, name="batchwire-native-output", daemon=True).start()
