"""A test's Python code in a subprocess whose ``/dev/shm`` is a fresh, tiny tmpfs.

``run_python(source, shm=...)`` runs ``source`` with the test's own interpreter
(``sys.executable -c source``) inside a private mount namespace (``unshare --mount
--propagation private``). There, and only there, ``/dev/shm`` and each directory named in
``tmpfs`` is a new tmpfs of ``size`` bytes in one of these states:

- ``"empty"``: anyone may write in it (mode 1777), and it has ``size`` of room;
- ``"full"``: one file filled it until the kernel answered ENOSPC. A name can still be
  made (an empty file, ``mkstemp``) but not one more byte written: Docker's 64 MiB
  ``/dev/shm`` once DataLoader workers have used it;
- ``"no-inodes"``: no file can be made at all (ENOSPC at ``open(O_CREAT)``);
- ``"read-only"``: mounted read-only (EROFS, for root too);
- ``"root-only"``: empty, but only root may write in it (mode 0755): EACCES for ``uid``.

The mounts go with the subprocess: the test's process and the host never see them, and
nothing is left to clean up. Root ignores permissions, so to see them apply pass ``uid``:
the code then runs as that user and group (``setpriv --reuid --regid --clear-groups``)
after the mounts. It gets the test process's environment with ``env`` over it and this
directory (``tests/``) first on ``PYTHONPATH``, so that it can import the test helpers and
test modules (which a spawned DataLoader worker must, to unpickle a dataset class);
``args`` become its ``sys.argv[1:]`` and ``cwd`` its working directory, entered after the
mounts. ``run_python`` returns the ``CompletedProcess``, stdout and stderr as text, whatever
its exit status; one still running after ``timeout`` seconds is killed with its process
group (DataLoader workers included) and fails the test with what it printed.

It needs Linux, root and util-linux's ``unshare`` (and ``setpriv`` for ``uid``):
``unsupported_reason()`` says which is missing, and ``run_python`` skips the test with
that reason.

This file is also the program that sets the namespace up: ``unshare`` runs ``python
namespaces.py SPEC -- COMMAND...``, which mounts, enters the working directory and
execs ``COMMAND``.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Literal, NoReturn

__all__ = ["State", "run_python", "unsupported_reason"]

State = Literal["empty", "full", "no-inodes", "read-only", "root-only"]
_STATES = ("empty", "full", "no-inodes", "read-only", "root-only")
_TESTS = pathlib.Path(__file__).resolve().parent
_UNSHARE = ["unshare", "--mount", "--propagation", "private", "--"]


@functools.cache
def _namespace_failure() -> str | None:
    try:
        done = subprocess.run(
            [*_UNSHARE, "true"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else done.stderr.strip() or f"exit {done.returncode}"


def unsupported_reason(*, uid: int | None = None) -> str | None:
    """Why ``run_python`` cannot run here (as ``uid``, if given), or None where it can."""
    if sys.platform != "linux":
        return f"mount namespaces are Linux's; this is {sys.platform}"
    if os.geteuid() != 0:
        return "mounting a tmpfs on /dev/shm in a mount namespace needs root"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    if uid is not None and shutil.which("setpriv") is None:
        return "util-linux's setpriv is not installed"
    failure = _namespace_failure()
    if failure is not None:
        return f"unshare --mount cannot make a mount namespace here: {failure}"
    return None


def run_python(
    source: str,
    *args: str,
    shm: State = "full",
    tmpfs: Mapping[str, State] | None = None,
    size: str = "64k",
    uid: int | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as described in the module; ``size`` is tmpfs's ``size=`` option
    (bytes, or with k, m, g), for each mount."""
    reason = unsupported_reason(uid=uid)
    if reason is not None:
        import pytest  # here: the program that sets the namespace up does without it

        pytest.skip(reason)
    mounts = {"/dev/shm": shm, **(tmpfs or {})}
    for directory, state in mounts.items():
        if state not in _STATES:
            raise ValueError(f"{directory}: state {state!r} is not one of {_STATES}")
        if not os.path.isdir(directory):
            raise ValueError(f"{directory} is not a directory to mount a tmpfs on")
    spec = {"mounts": list(mounts.items()), "size": size, "cwd": os.fspath(cwd or os.getcwd())}
    drop = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    command = [
        *_UNSHARE,
        sys.executable,
        __file__,
        json.dumps(spec),
        "--",
        *drop,
        sys.executable,
        "-c",
        source,
        *args,
    ]
    path = os.pathsep.join(filter(None, [str(_TESTS), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, **(env or {})}
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        start_new_session=True,  # its own process group: a timeout kills its workers too
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"the subprocess did not finish in {timeout:g} s; stdout:\n{stdout[-2000:]}\n"
            f"stderr:\n{stderr[-4000:]}"
        ) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _mount(directory: str, state: State, size: str) -> None:
    """Cover ``directory`` with a new tmpfs in ``state`` (see the module)."""
    options = [f"size={size}", "mode=0755" if state == "root-only" else "mode=1777"]
    if state == "no-inodes":
        options.append("nr_inodes=1")  # its root directory takes the only one
    mount = ["mount", "-t", "tmpfs", "-o", ",".join(options), "batchwire-test", directory]
    subprocess.run(mount, check=True)
    if state == "full":
        _fill(os.path.join(directory, ".filler"))
    elif state == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", directory], check=True)


def _fill(path: str) -> None:
    """Write ``path`` until its file system has no byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    block = bytes(4096)
    try:
        while True:
            os.write(fd, block)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


def _enter(argv: Sequence[str]) -> NoReturn:
    """In the new namespace: mount what ``argv[0]`` (the spec) says, then exec the
    command after ``--``."""
    spec = json.loads(argv[0])
    if argv[1] != "--" or len(argv) < 3:
        raise SystemExit(f"usage: namespaces.py SPEC -- COMMAND...; got {list(argv)!r}")
    for directory, state in spec["mounts"]:
        _mount(directory, state, spec["size"])
    os.chdir(spec["cwd"])
    command = list(argv[2:])
    os.execvp(command[0], command)


if __name__ == "__main__":
    _enter(sys.argv[1:])
