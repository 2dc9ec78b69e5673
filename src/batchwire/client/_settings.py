"""A loader's settings as read-only attributes: each the field of the object that holds
it (the loader's ``spec`` or ``options``), refusing to be set."""

from __future__ import annotations

from typing import Any

__all__ = ["Setting", "setting"]


class Setting:
    """A read-only attribute of a loader: field ``field`` (by default, the attribute's own
    name) of the object the loader keeps as ``holder`` (its ``_spec`` or ``_options``)."""

    def __init__(self, holder: str, field: str | None = None) -> None:
        self._holder, self._field, self._name = holder, field, field

    def __set_name__(self, owner: type, name: str) -> None:
        self._name, self._field = name, self._field or name

    def __get__(self, loader: object, owner: type | None = None) -> Any:
        if loader is None:
            return self
        return getattr(getattr(loader, self._holder), str(self._field))

    def __set__(self, loader: object, value: object) -> None:
        raise AttributeError(
            f"{type(loader).__name__}.{self._name} is read-only: a loader's settings are "
            "fixed when it is built"
        )


def setting(holder: str, field: str | None = None) -> Any:
    """A :class:`Setting`, typed as the attribute it is assigned to declares."""
    return Setting(holder, field)
