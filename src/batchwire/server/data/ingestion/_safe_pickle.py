"""Reading pickled values that may only hold plain data: nothing in them ever runs.

``safe_loads(data)`` accepts pickles made of ``bytes``/``bytearray``, ``str``,
``int``, ``float``, ``bool``, ``None``, tuples, lists and dicts, at any
protocol from 0 to 5. Anything else raises ``UnsafePickle`` naming what the
pickle would have done, and is refused *before* unpickling starts:

1. Every opcode is read with ``pickletools.genops`` (a parser that builds no
   object) and checked against an allowlist. Opcodes that import or call
   (``GLOBAL``, ``STACK_GLOBAL``, ``REDUCE``, ``INST``, ``OBJ``, ``NEWOBJ``,
   ``NEWOBJ_EX``, ``BUILD``, ``EXT1/2/4``, ``PERSID``/``BINPERSID``) and
   out-of-band buffers are never allowed.
2. Only then is the pickle loaded, by an ``Unpickler`` whose ``find_class`` and
   ``persistent_load`` refuse everything, as a second wall.

Python 3 writes ``bytes`` at protocols 0-2 as a call to ``_codecs.encode``, so
such pickles are refused too: their values must be re-pickled at protocol 3 or
later (the default since Python 3.0 is 3, since 3.8 it is 4).
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

from batchwire.server.errors import UnsafePickle

__all__ = ["UnsafePickle", "safe_loads"]

# Opcodes that only build plain values, push/pop the stack or use the memo.
_ALLOWED = frozenset(
    {
        "PROTO",
        "FRAME",
        "STOP",
        "MARK",
        "POP",
        "POP_MARK",
        "DUP",
        "PUT",
        "BINPUT",
        "LONG_BINPUT",
        "MEMOIZE",
        "GET",
        "BINGET",
        "LONG_BINGET",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "INT",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG",
        "LONG1",
        "LONG4",
        "FLOAT",
        "BINFLOAT",
        "STRING",
        "BINSTRING",
        "SHORT_BINSTRING",
        "UNICODE",
        "BINUNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE8",
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "BYTEARRAY8",
        "EMPTY_TUPLE",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "EMPTY_LIST",
        "APPEND",
        "APPENDS",
        "LIST",
        "EMPTY_DICT",
        "DICT",
        "SETITEM",
        "SETITEMS",
    }
)
_CALLS = frozenset(
    {"GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "BUILD"}
)


class _NothingUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickle(f"the pickle refers to {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("the pickle refers to a persistent object")


def _check(data: bytes) -> None:
    strings = ["", ""]  # the last two strings pushed: STACK_GLOBAL's module and name
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name in _ALLOWED:
                if isinstance(arg, str):
                    strings = [strings[1], arg]
                continue
            if name == "GLOBAL":
                target = str(arg).replace(" ", ".")
                raise UnsafePickle(f"it imports {target} (opcode GLOBAL) to call or build it")
            if name == "STACK_GLOBAL":
                target = ".".join(text[:60] for text in strings)
                raise UnsafePickle(f"it imports {target} (opcode STACK_GLOBAL) to call or build it")
            if name in _CALLS:
                raise UnsafePickle(f"it calls or builds an object (opcode {name})")
            raise UnsafePickle(f"opcode {name} is not plain data")
    except UnsafePickle:
        raise
    except Exception as exc:  # genops raises ValueError and others on malformed input
        raise UnsafePickle(f"it is not a valid pickle ({exc})") from None


def safe_loads(data: bytes | memoryview) -> Any:
    """The plain value pickled in ``data``; raises ``UnsafePickle`` for anything else."""
    data = bytes(data)
    if not data:
        raise UnsafePickle("it is empty, not a pickle")
    _check(data)
    try:
        # encoding="bytes": Python 2 str values come back as the bytes they were.
        return _NothingUnpickler(io.BytesIO(data), encoding="bytes").load()
    except UnsafePickle:
        raise
    except Exception as exc:
        raise UnsafePickle(f"it is not a valid pickle ({exc})") from None
