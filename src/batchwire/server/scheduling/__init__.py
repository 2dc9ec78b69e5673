"""Scheduling: the runners of a server shared among its streams. Each device has
``slots_per_device`` slots, a thread each, that run the batches of every stream's
:class:`Ticket` (its place in the fair queue), read and finished through the ticket's
:class:`StreamPort`, on the runner of its key, in the order of the
fairness policy (:class:`FairQueue`), building and keeping runners as keys come and go.
Never loads grpc.
"""

from __future__ import annotations

from batchwire.server.scheduling._fair import FairQueue
from batchwire.server.scheduling._scheduler import Scheduler, SchedulerStats
from batchwire.server.scheduling._ticket import StreamPort, Ticket

__all__ = ["FairQueue", "Scheduler", "SchedulerStats", "StreamPort", "Ticket"]
