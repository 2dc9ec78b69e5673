"""``python -m benchmarks --profile``: where a server's time and interpreter lock go.

A local ``batchwire serve`` streams ``--pipeline`` (``train``, ``val``, or the no-decode
stand-in ``nodecode``) to one ``RemoteLoader``. One stream first counts the server's context
switches a batch, by thread name (``/proc``); then ``py-spy`` samples the server twice,
``--duration`` seconds each (default 10):
every thread that runs (``py-spy record``), then the thread that holds the interpreter
lock (``--gil``). It prints the rate, the server's CPU per image, the share of the time the
lock was held, and the functions that hold it and that run, inclusive of their callees,
each as a share of its recording's samples. ``pip install py-spy`` first; sampling another
process may need root (or ``ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

from batchwire.bench import NO_DECODE_TOML, LocalServer, RunResult, bench_dataset, run_remote

__all__ = ["run_profile", "summarize", "switches"]

RATE = 200  # samples per second
SECONDS = 10
TOP = 25
_PATH = re.compile(r" \((?:/[^()]*?/(?:site-packages|src)/)?([^()]*)\)$")


def summarize(raw: str, top: int = TOP) -> tuple[int, list[tuple[float, str]]]:
    """The samples of a ``py-spy record -f raw`` file (one ``frame;frame;... count`` line a
    stack) and its ``top`` functions by inclusive share, as (percent, function)."""
    stacks: list[tuple[list[str], int]] = []
    for line in raw.splitlines():
        stack, _, samples = line.rpartition(" ")
        if stack and samples.isdigit():
            stacks.append((stack.split(";")[1:], int(samples)))  # the first is the thread
    total = sum(count for _, count in stacks)
    inclusive: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        for frame in {_PATH.sub(r" (\1)", frame) for frame in frames}:
            if "threading.py" not in frame:
                inclusive[frame] += count
    return total, [(100 * n / max(total, 1), f) for f, n in inclusive.most_common(top)]


def _record(pid: int, out: pathlib.Path, gil: bool, seconds: int) -> subprocess.Popen[bytes]:
    command = ["py-spy", "record", "-p", str(pid), "-r", str(RATE), "-d", str(seconds)]
    command += ["-f", "raw", "-o", str(out), "--nonblocking", *(["--gil"] if gil else [])]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def run_profile(args: argparse.Namespace) -> int:
    if shutil.which("py-spy") is None:
        print("error: py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    with (
        tempfile.TemporaryDirectory(prefix="batchwire-profile-") as work,
        LocalServer(data_dir, pathlib.Path(work), pipelines=NO_DECODE_TOML) as server,
    ):
        params = None if args.size is None else {"size": float(args.size)}

        def stream() -> RunResult:
            return run_remote(
                "profiled", [server.address], [server.pid], dataset, args.pipeline,
                args.batch_size, max(args.images, 2 * args.batch_size), params=params,
            )  # fmt: skip

        stream()  # warm-up: pipelines built, pages cached
        before = switches(server.pid)
        counted = stream()
        _print_switches(before, switches(server.pid), counted.images / args.batch_size)
        seconds = max(1, round(args.duration or SECONDS))
        for gil in (False, True):
            out = pathlib.Path(work) / f"py-spy-{'gil' if gil else 'threads'}.txt"
            last = _sampled(server.pid, out, gil, seconds, stream)
            if last is None:
                return 1
            total, rows = summarize(out.read_text())
            held = f", lock held {100 * total / (RATE * seconds):.0f} % of the time" if gil else ""
            print(
                f"\n{args.pipeline} at batch {args.batch_size}: {last.images_per_second:,.0f} "
                f"images/s, server {last.per_1000(last.server_cpu):.3f} CPU-ms per image{held}; "
                f"{total} samples of {'the lock holder' if gil else 'every running thread'}, "
                "by function (inclusive):"
            )
            for percent, frame in rows:
                print(f"{percent:6.1f} %  {frame}")
    return 0


def switches(pid: int) -> collections.Counter[str]:
    """Context switches (voluntary and not) of each live thread of ``pid`` so far, summed
    by the thread's name as the kernel knows it (Python's threads are all "python")."""
    counts: collections.Counter[str] = collections.Counter()
    for status in pathlib.Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
        except OSError:  # the thread ended
            continue
        counts[fields["Name"].strip()] += sum(
            int(fields[key]) for key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
        )
    return counts


def _print_switches(
    before: collections.Counter[str], after: collections.Counter[str], batches: float
) -> None:
    per_batch = {name: (after[name] - before[name]) / batches for name in after}
    shown = ", ".join(
        f"{name} {n:.1f}"
        for name, n in sorted(per_batch.items(), key=lambda kv: -kv[1])
        if n >= 0.5
    )
    print(f"\nserver context switches a batch: {sum(per_batch.values()):.1f} ({shown})")


def _sampled(
    pid: int, out: pathlib.Path, gil: bool, seconds: int, stream: Callable[[], RunResult]
) -> RunResult | None:
    """Stream while py-spy samples ``pid`` into ``out`` for ``seconds``: the last run, None
    if py-spy failed."""
    spy = _record(pid, out, gil, seconds)
    done = threading.Event()
    runs: list[RunResult] = []

    def keep_streaming() -> None:
        while not done.is_set():  # until py-spy is done, then one run more
            runs.append(stream())

    streamer = threading.Thread(target=keep_streaming, name="profile-stream")
    streamer.start()
    _, err = spy.communicate(timeout=seconds + 60)
    done.set()
    streamer.join(300)
    if spy.returncode != 0 or not out.exists():
        print(f"error: py-spy failed: {err.decode(errors='replace')[-500:]}", file=sys.stderr)
        return None
    return runs[-1]
