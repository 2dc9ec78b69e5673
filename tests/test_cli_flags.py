"""A misspelt flag or command: named in the usage of the command it was given to, with the
closest known one, as git does."""

from __future__ import annotations

import argparse

import pytest
from test_cli import _subcommands

from batchwire.cli import build_parser, main


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The stderr of ``batchwire *argv``, which must exit 2 as argparse does."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "unknown", "meant"),
    [
        (["serve", "--data-dirr", "datasets"], "--data-dirr", "--data-dir"),
        (
            ["ingest", "src", "out", "--name", "n", "--shard-sise", "9"],
            "--shard-sise",
            "--shard-size",
        ),
        (["bench", "--adress", "localhost:50051"], "--adress", "--address"),
    ],
)
def test_a_misspelt_flag_is_named_in_its_commands_usage_with_the_closest(
    argv: list[str], unknown: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(argv, capsys)
    command = f"batchwire {argv[0]}"
    assert err.startswith(f"usage: {command} [-h]"), err
    assert "usage: batchwire [-h]" not in err  # not the top level's
    last = err.splitlines()[-1]
    assert last == f"{command}: error: unrecognized argument: {unknown} (did you mean {meant}?)"


def test_every_commands_flags_are_suggested_when_misspelt(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    tried = 0
    for name, command in _subcommands().items():
        flags = {
            flag
            for action in command._actions
            if action.help != argparse.SUPPRESS
            for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"
        }
        assert flags, name
        for flag in sorted(flags):
            with pytest.raises(SystemExit):
                parser.parse_args([name, flag + flag[-1]])
            last = capsys.readouterr().err.splitlines()[-1]
            assert last.startswith(f"batchwire {name}: error: "), last
            assert f"unrecognized argument: {flag}{flag[-1]} (did you mean {flag}?)" in last
            tried += 1
    assert tried > 40  # every command's flags, the log options among them


def test_a_flag_and_its_value_in_one_word_get_both_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    last = _refused(["serve", "--data-dirr=/data"], capsys).splitlines()[-1]
    assert last == (
        "batchwire serve: error: unrecognized argument: --data-dirr=/data "
        "(did you mean --data-dir=/data?)"
    )


def test_a_misspelt_required_flag_is_named_with_the_one_it_misses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _refused(["ingest", "src", "out", "--nmae", "shapes"], capsys)
    assert err.splitlines()[-1] == (
        "batchwire ingest: error: unrecognized argument: --nmae (did you mean --name?); "
        "the following arguments are required: --name"
    )
    # Shown as required in the usage still, and alone when nothing else is wrong.
    assert "usage: batchwire ingest [-h] --name NAME" in err
    err = _refused(["ingest", "src", "out"], capsys)
    assert err.startswith("usage: batchwire ingest [-h] --name NAME")
    assert err.splitlines()[-1] == (
        "batchwire ingest: error: the following arguments are required: --name"
    )
    err = _refused(["ingest", "src", "out", "--name", "shapes", "--shard-size", "many"], capsys)
    assert err.startswith("usage: batchwire ingest [-h] --name NAME")
    assert "argument --shard-size: invalid int value: 'many'" in err


def test_an_unknown_flag_without_a_close_one_is_named_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _refused(["serve", "--zqxj", "1", "--data-dir", "x"], capsys)
    assert err.startswith("usage: batchwire serve [-h]")
    assert err.splitlines()[-1] == "batchwire serve: error: unrecognized argument: --zqxj"
    last = _refused(["serve", "--data-dirr", "x", "--zqxj", "--prot", "0"], capsys)
    assert last.splitlines()[-1] == (
        "batchwire serve: error: unrecognized arguments: --data-dirr (did you mean "
        "--data-dir?), --zqxj, --prot (did you mean --port?)"
    )
    # Words that are not flags are named where there is nothing else.
    last = _refused(["serve", "datasets"], capsys).splitlines()[-1]
    assert last == "batchwire serve: error: unrecognized argument: datasets"


def test_a_misspelt_command_or_choice_gets_the_closest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _refused(["serv", "--data-dir", "x"], capsys)
    assert err.startswith("usage: batchwire [-h]")
    assert "argument COMMAND: invalid choice: 'serv' (did you mean 'serve'?); choose from" in err
    err = _refused(["health", "--log-level", "debug"], capsys)
    assert "invalid choice: 'debug' (did you mean 'DEBUG'?)" in err
    err = _refused(["frobnicate"], capsys)
    assert "invalid choice: 'frobnicate'" in err and "did you mean" not in err
    err = _refused(["--verison"], capsys)
    assert err.splitlines()[-1] == (
        "batchwire: error: unrecognized argument: --verison (did you mean --version?); "
        "the following arguments are required: COMMAND"
    )


def test_a_valid_command_line_still_parses() -> None:
    args = build_parser().parse_args(["serve", "--data-dir", "x", "--log-level", "DEBUG"])
    assert (args.command, str(args.data_dir), args.log_level) == ("serve", "x", "DEBUG")
    args = build_parser().parse_args(["--log-format", "json", "ingest", "s", "o", "--name", "n"])
    assert (args.command, args.name, args.log_format, args.log_level) == (
        "ingest",
        "n",
        "json",
        None,
    )
    # An unambiguous prefix is a flag still, as argparse has it.
    assert build_parser().parse_args(["ingest", "s", "o", "--nam", "n"]).name == "n"
