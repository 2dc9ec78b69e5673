"""The command line of ``python -m benchmarks``: one flag per mode, a function per mode.

The flags are those ``batchwire bench`` had when it shipped these modes, so that
``batchwire bench --X`` became ``python -m benchmarks --X``.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
from collections.abc import Callable, Sequence

from batchwire.bench import ServerStartError, add_run_arguments
from benchmarks import (
    autoscale,
    chaos,
    cold,
    fleet,
    host_trainers,
    longrun,
    messages,
    mix,
    profile,
    scaling,
    stages,
    streams,
)

__all__ = ["MODES", "build_parser", "main"]

Mode = Callable[[argparse.Namespace], int]

# A mode flag and the function that runs it. ``--duration`` alone is the long run;
# with --streams or --chaos it sets how long they run.
MODES: dict[str, Mode] = {
    "messages": messages.run_messages,
    "scaling": scaling.run_scaling,
    "stages": stages.run_stages,
    "streams": streams.run_streams,
    "mix": mix.run_mix,
    "fleet": fleet.run_fleet,
    "chaos": chaos.run_chaos,
    "cold": cold.run_cold,
    "profile": profile.run_profile,
    "host_trainers": host_trainers.run_host_trainers,
    "autoscale": autoscale.run_autoscale,
}
LONG_RUN: Mode = longrun.run_long


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=sys.modules["benchmarks"].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--messages", action="store_true", help="measure gRPC message sizes")
    modes.add_argument("--scaling", action="store_true", help="one vs two servers pinned to cores")
    modes.add_argument(
        "--host-trainers",
        metavar="K[,K...]",
        help="one server and K trainer processes on this host (--duration seconds each, "
        "default 20), with and without shared memory, with one worker and with two, next to "
        "DALI's own pipeline in one process: images/s against DALI's best, the server's CPU "
        "per image, the trainers' rates and each worker's share of the batches",
    )
    modes.add_argument(
        "--stages", action="store_true", help="CPU per image of each stage, DALI next to PIL"
    )
    modes.add_argument(
        "--streams",
        help="K[,K...]: one server under K concurrent streams each (--duration seconds a K, "
        "default 20): images/s, server threads and RSS, first batch, rate spread; the server's CPU, "
        "stage times and GPU memory",
    )
    modes.add_argument(
        "--mix",
        nargs="?",
        const=mix.DEFAULT_MIX,
        metavar="SPEC",
        help="one server shared by streams of several pipelines for --duration seconds (40): "
        "first batches, batches per stream, each pipeline's share of time, builds and switches. "
        f"SPEC: COUNT:PIPELINE[:PARAM=VALUE...],... (default {mix.DEFAULT_MIX})",
    )
    modes.add_argument(
        "--fleet",
        action="store_true",
        help="two servers on a core each, one sharing its core with busy processes: their "
        "solo rates against one loader over both",
    )
    modes.add_argument(
        "--chaos",
        action="store_true",
        help="three servers, two ranks, a server killed or drained and restarted every "
        "--every seconds for --duration seconds (default 300): samples lost and repeated",
    )
    modes.add_argument(
        "--cold",
        action="store_true",
        help="the global shuffle from a cold page cache next to warm, a new server each run "
        "(--duration seconds, default 20): images/s, server RSS, the read stage alone with and "
        "without read-ahead",
    )
    modes.add_argument(
        "--profile",
        action="store_true",
        help="py-spy on a local server streaming --pipeline (train, val or the no-decode "
        "stand-in nodecode) to one loader: where its time and interpreter lock go",
    )
    modes.add_argument(
        "--autoscale",
        action="store_true",
        help="an autoscaled fleet played with batchwire serve processes on this host: "
        "trainers rise and fall, the HPA's arithmetic on the servers' /metrics starts and "
        "stops servers; how fast it grows and shrinks, what a scale-down costs a trainer, "
        "every epoch checked",
    )
    _add_options(parser)
    return parser


def _add_options(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument(
        "--duration",
        type=float,
        help="alone: stream from a local server this many seconds, memory at start and end; "
        "with --streams, --mix or --chaos: how long they run; with --profile: seconds of "
        "each recording",
    )
    parser.add_argument(
        "--size", type=int, help="with --streams, --chaos or --profile: the pipeline's output size"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="with --streams or --mix: where the server runs its pipelines (default auto)",
    )
    parser.add_argument(
        "--every", type=float, default=5.0, help="with --chaos: seconds between stops (5)"
    )
    parser.add_argument(
        "--stops",
        type=int,
        default=0,
        help="with --chaos: stop at least this many servers, however long --duration is (0)",
    )
    parser.add_argument(
        "--cold-streams",
        default=",".join(map(str, cold.STREAMS)),
        help="with --cold: stream counts (default 1,4,16)",
    )
    parser.add_argument(
        "--cold-mixture",
        action="store_true",
        help="with --cold: a mixture of the dataset and a copy of it, half of each, beside the "
        "dataset alone, cold and warm",
    )
    parser.add_argument(
        "--host-servers",
        default=",".join(host_trainers.DEFAULT_SERVERS),
        help="with --host-trainers: which server settings, in order, of "
        f"{','.join(host_trainers.SERVERS)} (default {','.join(host_trainers.DEFAULT_SERVERS)})",
    )
    parser.add_argument("--json", type=pathlib.Path, help="write the results as JSON")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1 or args.images < args.batch_size or args.repeats < 1:
        print(
            "error: need --batch-size >= 1, --images >= --batch-size, --repeats >= 1",
            file=sys.stderr,
        )
        return 2
    chosen = [mode for flag, mode in MODES.items() if getattr(args, flag)]
    if not chosen and args.duration:
        chosen = [LONG_RUN]
    if not chosen:
        flags = ", ".join(f"--{flag}" for flag in MODES)
        print(f"error: give one of {flags}, or --duration alone (a long run)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    try:
        return chosen[0](args)
    except ServerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
