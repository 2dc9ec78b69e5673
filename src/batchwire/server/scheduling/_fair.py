"""Which batch the server's pipelines take next: every stream an equal share of their time.

The scheduler takes the requests of every ticket (:mod:`batchwire.server.scheduling._ticket`) in
the order the :class:`FairQueue` says, and hands each result back to its ticket.

The policy is weighted fair queuing over keys (a key is what a pipeline is built for:
pipeline, parameters, output format, batch size, device), with round robin inside a key:

- each key has a virtual time, the pipeline seconds per stream it has used: a batch of
  key ``k`` taken while ``w`` streams of ``k`` wait adds ``cost(k) / w``, where ``cost(k)``
  is the seconds one batch of ``k`` took lately, measured where the pipelines run. The
  next batch is of the key with the least virtual time. So time is shared by streams, not
  by keys: a key that 8 streams want gets 8 shares, a ``val`` pass beside them one, and a
  key whose batches cost twice as much gets half as many batches for its time;
- inside a key, streams take turns, one batch each (the waiting stream that has had the
  fewest batches goes first): the ranks of a DDP job move in step, and K new streams each
  get a first batch before any gets a second;
- a key, or a stream, that comes back after asking for nothing for a while (a slow
  client, a new epoch) starts level with those waiting: it is served at once, but earns
  no credit for the time it did not ask. A key keeps its virtual time while any stream of
  it is open.

A pipeline slot runs one key at a time, since DALI builds a graph per key. It keeps its key
while that key has the least virtual time, and in any case, once it switched, for a quantum
of ``QUANTUM_BATCHES`` of the key's batches (at least ``min_quantum`` seconds), or for
``BUILD_AMORTIZE`` times the build when it had to drop another key's pipeline to build
this one; so switches, and rebuilds when more keys are active than a slot keeps built, are
bounded in rate. On a tie, a slot keeps the key it runs, or takes one it has built.

Not thread-safe: the scheduler calls it under its lock.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Collection

from batchwire.server.runners import RunnerKey
from batchwire.server.scheduling._ticket import Ticket

__all__ = ["BUILD_AMORTIZE", "QUANTUM_BATCHES", "FairQueue"]

QUANTUM_BATCHES = 4  # a slot that switched keys runs at least this many batches' time
BUILD_AMORTIZE = 4.0  # ... and, having evicted a pipeline to build, this many build times
_DEFAULT_COST_S = 0.005  # a batch's cost before any batch of any key was measured
_COST_WEIGHT = 0.2  # the weight of the latest measurement in a key's average cost


@dataclasses.dataclass(eq=False)
class _Key:
    """One key's share: its virtual time, its open and waiting tickets, its cost."""

    vtime: float = 0.0
    tickets: int = 0  # open tickets of the key
    # The waiting tickets, by batches served: (served, order, ticket); an entry is live
    # only while its order is the ticket's ``queued`` (``served`` changes on each take).
    heap: list[tuple[int, int, Ticket]] = dataclasses.field(default_factory=list)
    waiting: set[Ticket] = dataclasses.field(default_factory=set)
    cost: float | None = None  # seconds per batch, measured


class FairQueue:
    """The tickets waiting for a pipeline, by key, in the policy's order."""

    def __init__(self, *, min_quantum: float = 0.02) -> None:
        self.min_quantum = min_quantum
        self._keys: dict[RunnerKey, _Key] = {}
        self._order = itertools.count()

    # -- tickets ------------------------------------------------------------------------

    def open(self, ticket: Ticket) -> None:
        """``ticket`` exists: its key keeps its share while it is open."""
        self._keys.setdefault(ticket.key, _Key()).tickets += 1

    def close(self, ticket: Ticket) -> None:
        """``ticket`` is closed: it asks for nothing more."""
        state = self._keys.get(ticket.key)
        ticket.pending.clear()
        ticket.queued = None
        if state is None:
            return
        state.waiting.discard(ticket)
        state.tickets -= 1
        if state.tickets <= 0:
            del self._keys[ticket.key]

    def ask(self, ticket: Ticket, room: int, more: int = 0) -> bool:
        """``ticket`` may ask for ``room`` more batches, and its stream has ``more``
        batches more: those now allowed join its pending requests, and it is queued if it
        is not already. Whether any joined (a slot may have something new to run)."""
        ticket.count += more
        ticket.allowed += room
        end = min(ticket.allowed, ticket.count)
        if ticket.requested >= end:
            return False
        now = time.monotonic()
        ticket.pending.extend((seq, now) for seq in range(ticket.requested, end))
        ticket.requested = end
        self._add(ticket)
        return True

    def _add(self, ticket: Ticket) -> None:
        """``ticket`` has pending requests: queue it if it is not queued already."""
        state = self._keys.get(ticket.key)
        if state is None or ticket.queued is not None or not ticket.pending:
            return
        if not state.waiting:  # the key comes back: level with the keys waiting
            floor = self._floor(ticket.key.device_id)
            if floor is not None:
                state.vtime = max(state.vtime, floor)
        least = min((t.served for t in state.waiting), default=None)
        if least is not None:  # the stream comes back: level with its key's streams
            ticket.served = max(ticket.served, least)
        self._push(state, ticket)

    def _push(self, state: _Key, ticket: Ticket) -> None:
        order = next(self._order)
        ticket.queued = order
        state.waiting.add(ticket)
        heapq.heappush(state.heap, (ticket.served, order, ticket))

    def take(self, key: RunnerKey) -> tuple[Ticket, int, float] | None:
        """The next request of ``key``: (ticket, batch, seconds it waited), charged to the
        key; None when no ticket of ``key`` waits."""
        state = self._keys.get(key)
        if state is None or not state.waiting:
            return None
        while True:
            _, order, ticket = heapq.heappop(state.heap)
            if ticket.queued == order:
                break
        state.vtime += self.cost(key) / len(state.waiting)
        seq, asked = ticket.pending.popleft()
        ticket.served += 1
        ticket.queued = None
        state.waiting.discard(ticket)
        if ticket.pending:
            self._push(state, ticket)
        return ticket, seq, time.monotonic() - asked

    def waiting(self, key: RunnerKey) -> list[Ticket]:
        """The tickets of ``key`` with requests waiting, taken out of the queue (for
        failing them all)."""
        state = self._keys.get(key)
        if state is None:
            return []
        tickets = list(state.waiting)
        state.waiting.clear()
        state.heap.clear()
        for ticket in tickets:
            ticket.queued = None
        return tickets

    def queued(self) -> dict[RunnerKey, int]:
        """Batches asked for and not yet taken, by key (keys with any waiting)."""
        return {
            key: sum(len(t.pending) for t in state.waiting)
            for key, state in self._keys.items()
            if state.waiting
        }

    # -- keys ---------------------------------------------------------------------------

    def keys(self, device_id: int | None) -> list[RunnerKey]:
        """The keys of ``device_id`` with a ticket waiting."""
        return [k for k, s in self._keys.items() if k.device_id == device_id and s.waiting]

    def _floor(self, device_id: int | None) -> float | None:
        """The least virtual time of the keys waiting on ``device_id`` (None: none waits)."""
        return min((self._keys[k].vtime for k in self.keys(device_id)), default=None)

    def choose(
        self, device_id: int | None, built: Collection[RunnerKey], current: RunnerKey | None
    ) -> RunnerKey | None:
        """The key a slot of ``device_id`` runs next: the one with the least virtual time;
        on a tie, the one it runs now, then one it has built."""
        best: tuple[float, int, RunnerKey] | None = None
        for key in self.keys(device_id):
            rank = 0 if key == current else 1 if key in built else 2
            candidate = (self._keys[key].vtime, rank, key)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else best[2]

    def stay(self, key: RunnerKey, rebuilt_seconds: float = 0.0) -> float:
        """Seconds a slot keeps ``key`` once it switched to it, having spent
        ``rebuilt_seconds`` building its pipeline in place of another key's."""
        state = self._keys.get(key)
        cost = 0.0 if state is None or state.cost is None else state.cost  # unknown: the least
        return max(self.min_quantum, QUANTUM_BATCHES * cost, BUILD_AMORTIZE * rebuilt_seconds)

    # -- costs --------------------------------------------------------------------------

    def cost(self, key: RunnerKey) -> float:
        """Seconds one batch of ``key`` costs, as measured lately (before any measurement:
        the average of the keys measured, else a default)."""
        state = self._keys.get(key)
        if state is not None and state.cost is not None:
            return state.cost
        known = [s.cost for s in self._keys.values() if s.cost is not None]
        return sum(known) / len(known) if known else _DEFAULT_COST_S

    def measured(self, key: RunnerKey, seconds: float) -> None:
        """A batch of ``key`` took ``seconds`` of a slot's time."""
        state = self._keys.get(key)
        if state is None:
            return  # no stream of the key is open any more
        cost = state.cost
        state.cost = seconds if cost is None else cost + _COST_WEIGHT * (seconds - cost)
