"""The health states of a unit's worker processes, in shared memory, so every worker
answers health checks for the whole unit.

``batchwire serve --workers N`` runs N servers behind one port: a probe lands on
whichever worker the kernel picks, and must get the same answer from each. Each
worker writes its own state into its entry of one shared array (one writer per
entry: no lock is needed for a single ``int``) and reads every entry, at each health
check and every poll, to decide what its health service reports: SERVING only when
every worker is SERVING.

The parent creates the array (:meth:`WorkerStates.create`) before it starts the
workers and marks a worker :data:`EXITED` when its process ends.
"""

from __future__ import annotations

import enum
import multiprocessing.context
from collections.abc import Sequence
from typing import Any

__all__ = ["State", "UnitMember", "WorkerStates"]


class State(enum.IntEnum):
    """One worker's state, as its entry holds it."""

    STARTING = 0  # spawned, not yet listening
    WARMING = 1  # listening; datasets or a pipeline not ready (or no datasets)
    SERVING = 2
    BROKEN = 3  # warm, but a device is broken
    DRAINING = 4
    EXITED = 5  # the process ended (written by the parent)


class WorkerStates:
    """One entry per worker in a shared ``int`` array; picklable into spawned workers
    (pass it as a ``Process`` argument)."""

    def __init__(self, array: Any) -> None:
        self._array = array

    @classmethod
    def create(cls, context: multiprocessing.context.BaseContext, workers: int) -> WorkerStates:
        """``workers`` entries, all :data:`State.STARTING`."""
        return cls(context.RawArray("i", [State.STARTING] * workers))

    def __len__(self) -> int:
        return len(self._array)

    def set(self, index: int, state: State) -> None:
        self._array[index] = int(state)

    def snapshot(self) -> Sequence[State]:
        """Every worker's state now, by index."""
        return [State(value) for value in self._array[:]]

    def all_serving(self) -> bool:
        return all(value == State.SERVING for value in self._array[:])

    def member(self, index: int) -> UnitMember:
        return UnitMember(self, index)


class UnitMember:
    """What one worker's server sees of the unit: it publishes its own state and
    asks whether the whole unit serves."""

    def __init__(self, states: WorkerStates, index: int) -> None:
        if not 0 <= index < len(states):
            raise ValueError(f"worker {index} is not one of {len(states)}")
        self._states = states
        self.index = index

    def publish(self, state: State) -> None:
        self._states.set(self.index, state)

    def unit_serving(self) -> bool:
        """Whether every worker of the unit reports SERVING."""
        return self._states.all_serving()
