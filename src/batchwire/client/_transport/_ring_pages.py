"""The pages of servers' rings in this process (``RingReader``'s), below Python's
``mmap``, and what a fork does to them, none of it on a batch's way: where a ring is
mapped; the lock a fork waits on; in a forked child, the batches lent to its parent
copied into the child's own memory in place, the rest of each ring reserved, and the
rings' descriptors put to /dev/null."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import weakref
from typing import Protocol

import numpy as np

from batchwire.common.shared_memory import MEMFD_NAME

__all__ = ["MAP_NORESERVE", "PAGE", "fork_lock", "keep_lent", "mapped_at", "readers"]


class _Reader(Protocol):
    def _forked(self) -> None: ...


# A fork waits while a descriptor is being received or a ring mapped, so that a child
# never inherits one that is not yet accounted for (``RingReader._forked``).
fork_lock = threading.Lock()
readers: weakref.WeakSet[_Reader] = weakref.WeakSet()


def mapped_at(ring: mmap.mmap) -> int:
    """Where ``ring`` is mapped in this process."""
    view = np.frombuffer(ring, np.uint8)
    try:
        return int(view.ctypes.data)
    finally:
        del view


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_void_p,
)
MAP_NORESERVE = 0x4000  # Linux's; not in Python 3.11's mmap
_MAP_FIXED_NORESERVE = 0x10 | MAP_NORESERVE  # MAP_FIXED | MAP_NORESERVE
_MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP_MAYMOVE_FIXED = 1 | 2
PAGE = mmap.PAGESIZE


def _reserve(address: int, length: int) -> None:
    """``length`` bytes at ``address`` this process's, mapped to nothing (``PROT_NONE``):
    what was there is gone, and nothing else is put there meanwhile."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NORESERVE
    _libc.mmap(address, length, 0, flags, -1, 0)  # PROT_NONE


def _copy_out(start: int, size: int) -> int:
    """A copy of ``size`` bytes at ``start`` in new memory of this process (0 if none)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    copy = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if copy in (None, _MAP_FAILED):
        return 0
    ctypes.memmove(copy, start, size)
    return int(copy)


def _move(copy: int, size: int, start: int) -> None:
    """The memory at ``copy`` moved to ``start``, in place of what was there."""
    _libc.mremap(copy, size, size, _MREMAP_MAYMOVE_FIXED, start)


def keep_lent(start: int, length: int, lent: list[tuple[int, int]]) -> None:
    """In a forked child, a ring of ``length`` bytes at ``start`` that its parent mapped:
    the ``lent`` spans (address, bytes) copied into the child's own memory, in place, and
    the rest reserved."""
    copies = [(at, size, _copy_out(at, size)) for at, size in lent]
    _reserve(start, length)
    for at, size, copy in copies:
        if copy:
            _move(copy, size, at)


def _before_fork() -> None:
    fork_lock.acquire()


def _after_fork_in_parent() -> None:
    fork_lock.release()


def _after_fork_in_child() -> None:
    fork_lock.release()
    for call in list(readers):
        call._forked()
    # Python's mmap keeps a duplicate of the descriptor it mapped, which a fork copies.
    # Its number is put to /dev/null rather than closed: the mmap object closes it
    # when dropped, and must not close whatever the child opens there meanwhile.
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return
    devnull = -1
    for name in descriptors:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith(f"/memfd:{MEMFD_NAME}"):
                continue
            if devnull < 0:
                devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            os.dup2(devnull, int(name))
        except OSError:
            continue
    if devnull >= 0:
        os.close(devnull)


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
