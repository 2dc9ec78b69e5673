"""The ``batchwire`` command's argument parser: argparse's, with errors that say what was meant.

An unknown flag is named in the usage of the command it was given to, with the known flag
closest to it (``batchwire serve: error: unrecognized argument: --data-dirr (did you mean
--data-dir?)``), beside any required flag that is missing; an unknown choice (a command's
name, ``--log-level``) gets the closest choice. Python 3.14's ``suggest_on_error`` does the
latter; Python 3.11 has neither.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

__all__ = ["Parser"]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that reports unknown arguments itself, with suggestions.

    Unknown arguments are an error in ``parse_known_args`` too: argparse hands a command's
    arguments to the command's parser through that method, and only that parser knows the
    flags the unknown one was meant to be, and has the usage to show.
    """

    _deferred: Sequence[argparse.Action] = ()

    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        """As ``parse_args``: unknown arguments are reported, not returned (the list is empty
        for argparse, whose subcommands call this)."""
        # argparse stops at a missing required argument before it looks for unknown ones,
        # so that a misspelt `--name` would be reported only as missing: check after them.
        required = [a for a in self._actions if a.required]
        self._deferred = required
        for action in required:
            action.required = False
        try:
            parsed, extras = super().parse_known_args(args, namespace)
        finally:
            self._require_deferred()
        missing = [a for a in required if _not_given(a, parsed)]
        problems = [_unrecognized(extras, self._known_flags())] if extras else []
        if missing:
            names = ", ".join(
                "/".join(a.option_strings) or str(a.metavar or a.dest) for a in missing
            )
            problems.append(f"the following arguments are required: {names}")
        if problems:
            self.error("; ".join(problems))
        return parsed, []

    def error(self, message: str) -> NoReturn:
        # argparse reports its own errors while required arguments are deferred: the usage
        # shows them as required.
        self._require_deferred()
        super().error(message)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            # Case aside: `--log-level debug` means DEBUG.
            choices = {str(choice).lower(): str(choice) for choice in action.choices or ()}
            close = difflib.get_close_matches(str(value).lower(), choices, n=1)
            if not close:
                raise
            listed = ", ".join(map(repr, choices.values()))
            meant = choices[close[0]]
            message = f"invalid choice: {value!r} (did you mean {meant!r}?); choose from {listed}"
            raise argparse.ArgumentError(action, message) from None

    def _require_deferred(self) -> None:
        for action in self._deferred:
            action.required = True
        self._deferred = ()

    def _known_flags(self) -> list[str]:
        return [
            flag
            for action in self._actions
            if action.help != argparse.SUPPRESS  # deprecated flags are not offered
            for flag in action.option_strings
        ]


def _not_given(action: argparse.Action, parsed: argparse.Namespace) -> bool:
    # argparse leaves an argument that was not given at its default, the very object.
    return getattr(parsed, action.dest, None) is action.default


def _unrecognized(extras: list[str], known: list[str]) -> str:
    """``extras`` named, each flag with the closest of ``known``; the words after an unknown
    flag are most likely its value, so only the flags are named where there are any."""
    flags = [arg for arg in extras if arg.startswith("-") and arg != "-"]
    named = [_with_suggestion(flag, known) for flag in flags] or extras
    return f"unrecognized argument{'s' if len(named) > 1 else ''}: {', '.join(named)}"


def _with_suggestion(arg: str, known: list[str]) -> str:
    flag, equals, value = arg.partition("=")
    close = difflib.get_close_matches(flag, known, n=1)
    return f"{arg} (did you mean {close[0]}{equals}{value}?)" if close else arg
