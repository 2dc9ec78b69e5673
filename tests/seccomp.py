"""Real kernel faults for a test's subprocess: a seccomp filter that makes chosen syscalls fail.

``refuse(rules)`` installs, on the calling process and every thread it already runs, a BPF
filter under which each matching syscall returns ``-errno`` at once (the kernel never runs it)
and every other syscall runs as usual. It is a fault injector, not a sandbox: a syscall the
rules do not name, or one made under another ABI (i386 via ``int 0x80``, x32), is allowed.

A filter cannot be removed; it holds for the rest of the process's life and is inherited
by every child it forks or execs. So call ``refuse`` only in a subprocess made for the test,
never in pytest's own process: prepend ``python_prelude(rules)`` to the child's script, so
the filter is in place before the script imports anything else.

x86_64 Linux only (the syscall numbers are x86_64's): elsewhere ``refuse`` raises
RuntimeError, and ``unsupported_reason()`` says why so that callers can skip first.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import pathlib
import platform
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["SYSCALLS", "Rule", "python_prelude", "refuse", "unsupported_reason"]

# x86_64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl), each with the width of its
# arguments as the C library passes them: "i" an int or unsigned (fds, flags, families), whose
# register's high word the caller leaves undefined and the kernel ignores; "l" a long, size,
# offset or pointer, all 64 bits of it. These are the calls a data server or its client makes
# to open files, share memory and talk over sockets.
SYSCALLS: dict[str, tuple[int, str]] = {
    "read": (0, "ill"),
    "write": (1, "ill"),
    "open": (2, "lii"),
    "close": (3, "i"),
    "mmap": (9, "lliiil"),  # addr, length, prot, flags, fd, offset
    "mprotect": (10, "lli"),
    "munmap": (11, "ll"),
    "ioctl": (16, "iil"),
    "pread64": (17, "illl"),
    "pwrite64": (18, "illl"),
    "mremap": (25, "lllil"),
    "madvise": (28, "lli"),
    "socket": (41, "iii"),
    "connect": (42, "ili"),
    "accept": (43, "ill"),
    "sendto": (44, "illili"),
    "recvfrom": (45, "illill"),
    "sendmsg": (46, "ili"),
    "recvmsg": (47, "ili"),
    "shutdown": (48, "ii"),
    "bind": (49, "ili"),
    "listen": (50, "ii"),
    "socketpair": (53, "iiil"),
    "setsockopt": (54, "iiili"),
    "getsockopt": (55, "iiill"),
    "fcntl": (72, "iil"),
    "fsync": (74, "i"),
    "ftruncate": (77, "il"),
    "openat": (257, "ilii"),
    "fallocate": (285, "iill"),
    "accept4": (288, "illi"),
    "eventfd2": (290, "ii"),
    "epoll_create1": (291, "i"),
    "dup3": (292, "iii"),
    "pipe2": (293, "li"),
    "seccomp": (317, "iil"),
    "getrandom": (318, "lli"),
    "memfd_create": (319, "li"),
}

_MAX_ERRNO = 4095  # the kernel clamps a filter's errno to this

# <linux/filter.h>, <linux/seccomp.h>, <linux/audit.h>, <linux/prctl.h>
_BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_BPF_RET_K = 0x06  # BPF_RET | BPF_K
_BPF_MAXINSNS = 4096
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_AUDIT_ARCH_X86_64 = 0xC000003E  # EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
# struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; }
_NR_OFFSET = 0
_ARCH_OFFSET = 4
_ARGS_OFFSET = 16
_PR_SET_SECCOMP = 22
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_MODE_FILTER = 2
_NR_SECCOMP = 317
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1


@dataclasses.dataclass(frozen=True)
class Rule:
    """Make ``syscall`` fail with ``errno``: always, or only when its argument number
    ``index`` (from 0) equals ``arg``.

    ``arg`` is compared as wide as the argument is (see ``SYSCALLS``): an int argument on
    its low 32 bits, as the kernel reads it (so ``arg=-100`` matches ``AT_FDCWD``, and
    ``arg`` must fit 32 bits); a long, size, offset or pointer on both words. For ``mmap``
    match the flags with ``index=3``: argument 0 is an address.
    """

    syscall: str
    errno: int
    arg: int | None = None
    index: int = 0

    def __post_init__(self) -> None:
        if self.syscall not in SYSCALLS:
            raise ValueError(f"unknown syscall {self.syscall!r}; known: {', '.join(SYSCALLS)}")
        if not 0 < self.errno <= _MAX_ERRNO:
            raise ValueError(f"errno must be in 1..{_MAX_ERRNO}, not {self.errno}")
        widths = SYSCALLS[self.syscall][1]
        if not 0 <= self.index < len(widths):
            raise ValueError(
                f"index must be in 0..{len(widths) - 1} ({self.syscall} takes "
                f"{len(widths)} arguments), not {self.index}"
            )
        bits = 32 if widths[self.index] == "i" else 64
        if self.arg is not None and not -(2 ** (bits - 1)) <= self.arg < 2**bits:
            raise ValueError(
                f"arg {self.arg} does not fit argument {self.index} of {self.syscall} ({bits} bits)"
            )


class _SockFilter(ctypes.Structure):
    _fields_ = (
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    )


class _SockFprog(ctypes.Structure):
    _fields_ = (
        ("len", ctypes.c_ushort),
        ("filter", ctypes.POINTER(_SockFilter)),
    )


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
    return (code, jt, jf, k)


def _rule_block(rule: Rule) -> list[tuple[int, int, int, int]]:
    """Instructions that return the rule's errno when it matches and fall through past
    themselves when it does not; every jump stays inside the block."""
    number, widths = SYSCALLS[rule.syscall]
    checks = [(_NR_OFFSET, number)]
    if rule.arg is not None:
        value = rule.arg & 0xFFFF_FFFF_FFFF_FFFF
        low = _ARGS_OFFSET + 8 * rule.index  # little endian: the low word comes first
        checks.append((low, value & 0xFFFF_FFFF))
        if widths[rule.index] == "l":
            checks.append((low + 4, value >> 32))
    length = 2 * len(checks) + 1
    block = []
    for offset, expected in checks:
        block.append(_insn(_BPF_LD_W_ABS, offset))
        # On a mismatch, jump to the first instruction after this block.
        block.append(_insn(_BPF_JEQ_K, expected, jf=length - len(block) - 1))
    block.append(_insn(_BPF_RET_K, _RET_ERRNO | rule.errno))
    return block


def _program(rules: Sequence[Rule]) -> list[tuple[int, int, int, int]]:
    program = [
        # The numbers below are x86_64's: under any other ABI, allow everything.
        _insn(_BPF_LD_W_ABS, _ARCH_OFFSET),
        _insn(_BPF_JEQ_K, _AUDIT_ARCH_X86_64, jt=1),
        _insn(_BPF_RET_K, _RET_ALLOW),
    ]
    for rule in rules:  # the first rule that matches decides
        program += _rule_block(rule)
    program.append(_insn(_BPF_RET_K, _RET_ALLOW))
    return program


def unsupported_reason() -> str | None:
    """Why ``refuse`` cannot work in this Python, or None where it can."""
    if sys.platform != "linux":
        return f"seccomp filters are Linux's; this is {sys.platform}"
    if platform.machine() != "x86_64" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return (
            f"the syscall numbers are x86_64's; this is a {8 * ctypes.sizeof(ctypes.c_void_p)}"
            f"-bit Python on {platform.machine()}"
        )
    return None


def _thread_count() -> int:
    """Threads of this process, Python's and any a C library started."""
    return len(os.listdir("/proc/self/task"))


def refuse(rules: Sequence[Rule]) -> None:
    """Install a filter that makes each rule's syscall fail with its errno, on this process
    and every thread it runs now or starts later; irreversible.

    Raises RuntimeError where the filter cannot work (not x86_64 Linux) or cannot reach
    every thread; ValueError where the rules need more than the kernel's 4096 BPF
    instructions (584 rules always fit); OSError where the kernel refuses the filter.
    """
    reason = unsupported_reason()
    if reason is not None:
        raise RuntimeError(f"seccomp.refuse: {reason}")
    instructions = _program(rules)
    if len(instructions) > _BPF_MAXINSNS:
        raise ValueError(
            f"{len(rules)} rules need {len(instructions)} BPF instructions, over "
            f"the kernel's {_BPF_MAXINSNS}"
        )
    array = (_SockFilter * len(instructions))(*(_SockFilter(*insn) for insn in instructions))
    prog = _SockFprog(len(instructions), array)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.restype = ctypes.c_int
    libc.syscall.restype = ctypes.c_long

    # Without it an unprivileged process may not install a filter (and with it, a filter
    # cannot be used to fool a setuid program).
    zero = ctypes.c_ulong(0)  # prctl is variadic: pass whole longs, no junk high words
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), zero, zero, zero) != 0:
        _raise_errno("prctl(PR_SET_NO_NEW_PRIVS)")
    result = libc.syscall(
        ctypes.c_long(_NR_SECCOMP),
        ctypes.c_ulong(_SECCOMP_SET_MODE_FILTER),
        ctypes.c_ulong(_SECCOMP_FILTER_FLAG_TSYNC),
        ctypes.byref(prog),
    )
    if result == 0:
        return
    if result > 0:
        # TSYNC names the thread that could not take the filter (it has diverged from ours).
        raise RuntimeError(f"seccomp(TSYNC): thread {result} cannot take the filter")
    error = ctypes.get_errno()
    # ENOSYS: no seccomp() syscall (before 3.17); EINVAL: it lacks TSYNC. prctl's filter
    # reaches the calling thread only, so it is enough only while there is no other.
    if error not in (errno.ENOSYS, errno.EINVAL):
        _raise_errno("seccomp(SECCOMP_SET_MODE_FILTER, TSYNC)", error)
    others = _thread_count() - 1
    if others:
        raise RuntimeError(
            f"seccomp without TSYNC ({os.strerror(error)}) cannot reach the {others} other "
            f"threads of this process: call refuse() before any thread starts"
        )
    if libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(prog)) != 0:
        _raise_errno("prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)")


def _raise_errno(call: str, error: int | None = None) -> NoReturn:
    error = ctypes.get_errno() if error is None else error
    raise OSError(error, f"{call}: {os.strerror(error)}")


def python_prelude(rules: Sequence[Rule]) -> str:
    """Python source that installs ``rules`` on the process that runs it: prepend it to a
    subprocess's script (``[sys.executable, "-c", python_prelude(rules) + script]``)."""
    # int(): an IntEnum such as socket.AF_UNIX would print as <AddressFamily.AF_UNIX: 1>.
    listed = ", ".join(
        f"_seccomp.Rule({rule.syscall!r}, {int(rule.errno)}, "
        f"arg={None if rule.arg is None else int(rule.arg)}, index={int(rule.index)})"
        for rule in rules
    )
    tests = str(pathlib.Path(__file__).resolve().parent)
    return (
        f"import sys as _sys\n"
        f"_sys.path.insert(0, {tests!r})\n"
        f"import seccomp as _seccomp\n"
        f"_seccomp.refuse([{listed}])\n"
        f"del _sys, _seccomp\n"
    )
