"""tests/seccomp.py against the real kernel: each filter goes on a child Python of its own,
which reports back, as one JSON line, the errno that each of its calls got (0: it worked)."""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import socket
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from seccomp import Rule, python_prelude, unsupported_reason

pytestmark = pytest.mark.skipif(unsupported_reason() is not None, reason=unsupported_reason() or "")

# What every child script starts with, after any prelude: a way to report one call's errno.
CHILD_HELPERS = """
import errno, json, os, socket, sys

def errno_of(call, *args, **kwargs):
    try:
        result = call(*args, **kwargs)
    except OSError as error:
        return error.errno
    if hasattr(result, "close"):
        result.close()
    elif isinstance(result, int):
        os.close(result)
    return 0

def report(**results):
    print(json.dumps(results))
"""


def run_child(script: str, prelude: str = "") -> dict[str, Any]:
    """Run ``prelude`` (usually the filter) then ``script`` in a fresh Python; return what it
    passed to ``report``."""
    source = prelude + CHILD_HELPERS + textwrap.dedent(script)
    done = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def seccomp_status(status: str) -> tuple[int, int]:
    """(Seccomp mode, number of filters) from a /proc/.../status text."""
    mode = re.search(r"^Seccomp:\s+(\d+)$", status, re.MULTILINE)
    filters = re.search(r"^Seccomp_filters:\s+(\d+)$", status, re.MULTILINE)
    assert mode is not None and filters is not None, status
    return int(mode.group(1)), int(filters.group(1))


def test_memfd_create_fails_with_the_rules_errno_and_files_still_open() -> None:
    got = run_child(
        """
        report(memfd=errno_of(os.memfd_create, "x"), devnull=errno_of(open, "/dev/null"))
        """,
        python_prelude([Rule("memfd_create", errno.EMFILE)]),
    )
    assert got == {"memfd": errno.EMFILE, "devnull": 0}


def test_socket_rule_refuses_only_the_family_it_names() -> None:
    got = run_child(
        """
        report(
            unix=errno_of(socket.socket, socket.AF_UNIX, socket.SOCK_STREAM),
            inet=errno_of(socket.socket, socket.AF_INET, socket.SOCK_STREAM),
        )
        """,
        python_prelude([Rule("socket", errno.EACCES, arg=socket.AF_UNIX)]),
    )
    assert got == {"unix": errno.EACCES, "inet": 0}


def test_a_64_bit_argument_must_match_in_both_words() -> None:
    # ftruncate's length is an off_t: 4 KiB and 4 GiB + 4 KiB share their low word.
    length = (1 << 32) + 4096
    got = run_child(
        f"""
        fd = os.memfd_create("sparse")
        report(
            low_word_only=errno_of(os.ftruncate, fd, 4096),
            both_words=errno_of(os.ftruncate, fd, {length}),
        )
        """,
        python_prelude([Rule("ftruncate", errno.EFBIG, arg=length, index=1)]),
    )
    assert got == {"low_word_only": 0, "both_words": errno.EFBIG}


def test_an_int_argument_is_matched_on_its_low_word_as_the_kernel_reads_it() -> None:
    # socket(2) reads its family as an int: junk in the register's high word is ignored by
    # the kernel, so the filter must ignore it too.
    got = run_child(
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        family = ctypes.c_long(socket.AF_UNIX | 0x5A5A << 32)
        fd = libc.syscall(ctypes.c_long(41), family, ctypes.c_long(socket.SOCK_STREAM), ctypes.c_long(0))
        report(result=fd, errno=ctypes.get_errno())
        """,
        python_prelude([Rule("socket", errno.EACCES, arg=socket.AF_UNIX)]),
    )
    assert got == {"result": -1, "errno": errno.EACCES}


def test_a_negative_int_arg_matches_at_fdcwd_as_glibc_passes_it() -> None:
    # glibc passes AT_FDCWD (-100) zero-extended: openat(AT_FDCWD, ...) is refused all the
    # same, openat(a directory's fd, ...) is not. The filter's module and the child's are
    # imported, and /dev opened, before the filter goes on: after it, no path opens.
    prelude = f"""
import errno, json, os, socket, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import seccomp
dev = os.open("/dev", os.O_RDONLY | os.O_DIRECTORY)
seccomp.refuse([seccomp.Rule("openat", {errno.EACCES}, arg=-100)])
"""
    got = run_child(
        """
        report(
            cwd_relative=errno_of(os.open, "/dev/null", os.O_RDONLY),
            dir_relative=errno_of(os.open, "null", os.O_RDONLY, dir_fd=dev),
        )
        """,
        prelude,
    )
    assert got == {"cwd_relative": errno.EACCES, "dir_relative": 0}


def test_mmap_rule_matches_the_flags_argument() -> None:
    shared = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS
    got = run_child(
        """
        import mmap
        report(
            shared=errno_of(mmap.mmap, -1, 4096),
            private=errno_of(mmap.mmap, -1, 4096, mmap.MAP_PRIVATE),
        )
        """,
        python_prelude([Rule("mmap", errno.ENOMEM, arg=shared, index=3)]),
    )
    assert got == {"shared": errno.ENOMEM, "private": 0}


def test_the_filter_reaches_a_thread_started_before_it() -> None:
    # The thread waits until the main thread has installed the filter, then tries.
    got = run_child(
        f"""
        import threading
        go = threading.Event()
        seen = {{}}

        def attempt():
            go.wait(30)
            with open("/proc/thread-self/status") as status:
                seen["status"] = status.read()
            seen["memfd"] = errno_of(os.memfd_create, "x")

        thread = threading.Thread(target=attempt, name="started-before-the-filter")
        thread.start()
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import seccomp
        seccomp.refuse([seccomp.Rule("memfd_create", {errno.EMFILE})])
        go.set()
        thread.join(30)
        report(alive=thread.is_alive(), **seen)
        """
    )
    assert got["alive"] is False
    assert got["memfd"] == errno.EMFILE
    assert seccomp_status(got["status"])[0] == 2  # SECCOMP_MODE_FILTER in that thread


def test_without_tsync_it_falls_back_to_prctl_only_while_single_threaded() -> None:
    # A first filter makes seccomp() fail as a kernel without TSYNC does (EINVAL), so the
    # second refuse() goes through prctl(PR_SET_SECCOMP); a third, with a thread running,
    # must refuse rather than leave that thread unfiltered.
    got = run_child(
        """
        import threading
        import seccomp
        seccomp.refuse([seccomp.Rule("memfd_create", errno.EMFILE)])
        memfd = errno_of(os.memfd_create, "x")
        stop = threading.Event()
        thread = threading.Thread(target=stop.wait, args=(30,), name="blocks-the-fallback")
        thread.start()
        try:
            seccomp.refuse([seccomp.Rule("socket", errno.EACCES)])
            refused = ""
        except RuntimeError as error:
            refused = str(error)
        stop.set()
        thread.join(30)
        report(memfd=memfd, refused=refused, unix=errno_of(socket.socket, socket.AF_UNIX))
        """,
        python_prelude([Rule("seccomp", errno.EINVAL)]),
    )
    assert got["memfd"] == errno.EMFILE
    assert "without TSYNC" in got["refused"]
    assert got["unix"] == 0  # the refused filter was not installed anywhere


def test_the_parent_is_unaffected() -> None:
    with open("/proc/self/status") as status:
        before = seccomp_status(status.read())
    got = run_child(
        """
        with open("/proc/self/status") as status:
            report(status=status.read(), memfd=errno_of(os.memfd_create, "x"))
        """,
        python_prelude([Rule("memfd_create", errno.EMFILE), Rule("socket", errno.EACCES)]),
    )
    assert got["memfd"] == errno.EMFILE
    assert seccomp_status(got["status"]) == (2, before[1] + 1)

    with open("/proc/self/status") as status:
        assert seccomp_status(status.read()) == before
    os.close(os.memfd_create("parent"))
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"syscall": "no_such_call", "errno": errno.EIO}, "unknown syscall"),
        ({"syscall": "socket", "errno": 0}, "errno must be"),
        ({"syscall": "socket", "errno": 4096}, "errno must be"),
        ({"syscall": "socket", "errno": errno.EIO, "arg": 1, "index": 3}, "takes 3 arguments"),
        ({"syscall": "socket", "errno": errno.EIO, "arg": 1 << 32}, "32 bits"),
        ({"syscall": "socket", "errno": errno.EIO, "arg": -(1 << 31) - 1}, "32 bits"),
        ({"syscall": "ftruncate", "errno": errno.EIO, "arg": 1 << 64, "index": 1}, "64 bits"),
    ],
)
def test_rules_are_checked_when_made(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Rule(**kwargs)
