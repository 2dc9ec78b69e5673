"""The worker unit: ``batchwire serve --workers N``, N server processes behind one port.

:class:`WorkerUnit` binds the port once (``SO_REUSEPORT``), spawns the workers (each a
whole :class:`~batchwire.server.serving.BatchwireServer` on its share of the GPUs and
cores, :func:`plan_workers`), restarts none, ends with the first that fails, and serves one
metrics endpoint that scrapes each worker. The workers share their health states, so any
one answers a health check for all (:class:`~batchwire.server.serving.WorkerStates`).
"""

from __future__ import annotations

from batchwire.server.workers._unit import WorkerUnit, plan_workers

__all__ = ["WorkerUnit", "plan_workers"]
