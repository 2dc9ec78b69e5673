"""What a setting is: a field of the server's config declared with its help, how its text
is parsed and the values it takes (:func:`setting`), the same as ``batchwire serve``
takes it (:class:`Setting`: its flag, its environment variable, its check), read back
from the dataclass that declares them (:func:`declared`); and the parsers of setting
text that are not Python's own (:func:`device_ids`, :func:`boolean`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from batchwire.server.errors import ConfigError

__all__ = ["Setting", "boolean", "declared", "device_ids", "setting"]


def device_ids(text: str) -> tuple[int, ...]:
    """``--devices``: GPU ids as ``0,1,...``; ``all`` (or nothing) is every visible GPU."""
    value = text.strip().lower()
    if value in ("", "all"):
        return ()
    try:
        ids = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(
            f"not a list of GPU ids: {text!r} (use comma-separated numbers like 0,1 or 'all')"
        ) from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"GPU ids must be distinct numbers >= 0, got {text!r}")
    return ids


def boolean(text: str) -> bool:
    """A truth value as text: 1/true/yes/on or 0/false/no/off."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def setting(
    default: Any,
    help: str,
    parse: Callable[[str], Any] = int,
    *,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    bounds: tuple[float, float] | None = None,
    deprecated: bool = False,
) -> Any:
    """A ServerConfig field that is a setting: a flag ``--name``, a variable
    ``BATCHWIRE_NAME`` and a file key ``name`` (see :func:`declared`), with the values
    it takes (``choices``, or ``bounds`` inclusive). A ``deprecated`` one is still taken
    but left out of ``batchwire serve --help``."""
    metadata = {
        "help": help,
        "parse": parse,
        "metavar": metavar,
        "choices": choices,
        "bounds": bounds,
        "deprecated": deprecated,
    }
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ServerConfig field as ``batchwire serve`` takes it."""

    name: str
    help: str
    parse: Callable[[str], Any]
    metavar: str | None
    choices: tuple[str, ...] | None
    bounds: tuple[float, float] | None
    deprecated: bool = False

    def check(self, value: Any) -> None:
        """ConfigError unless ``value`` is one this setting takes (None: unset, where the
        setting may be left out)."""
        if self.choices is not None and value not in self.choices:
            raise ConfigError(
                f"{self.name} must be one of {', '.join(self.choices)}, got {value!r}"
            )
        if self.bounds is None or value is None:
            return
        low, high = self.bounds
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            raise ConfigError(f"{self.name} must be a number in [{low}, {high}], got {value!r}")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def variable(self) -> str:
        return "BATCHWIRE_" + self.name.upper()


_METADATA = ("help", "parse", "metavar", "choices", "bounds", "deprecated")


def declared(config: type) -> list[Setting]:
    """The settings of the dataclass ``config``, in declaration order: its fields made with
    :func:`setting`."""
    return [
        Setting(f.name, **{key: f.metadata[key] for key in _METADATA})
        for f in dataclasses.fields(config)
        if "help" in f.metadata
    ]
