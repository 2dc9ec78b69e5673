"""A dataset as the servers describe it: checked against the stream a loader asks for
(``describe_dataset``), and, once a process, the workers of a unit found by describing
it to each of them (``find_workers``). The calls go through the loader's ``Transport``.
"""

from __future__ import annotations

import logging
import math

from batchwire.client._servers import RETRIABLE, ServerSet
from batchwire.client._transport import (
    BatchwireError,
    InvalidArgumentError,
    NotFoundError,
    Server,
    Transport,
    host_of,
    rpc_details,
)
from batchwire.common.params import ParamRange, check_batch_size, check_params
from batchwire.common.stream import StreamSpec
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["announced_ranges", "describe_dataset", "find_workers"]

log = logging.getLogger(__name__)


def describe_dataset(
    transport: Transport, servers: ServerSet, spec: StreamSpec, *, timeout: float
) -> pb.DatasetInfo:
    """``spec``'s dataset as the first server that answers describes it, with ``spec``
    checked against what that server announces: NOT_FOUND if it has no such dataset or
    no such pipeline, INVALID_ARGUMENT (in the server's words) for a parameter the
    pipeline lacks or out of its range, or a batch over the server's limit."""
    error: BatchwireError | None = None
    for start in range(len(servers.servers())):
        server = servers.pick(start)
        try:
            info = transport.describe(server, spec.dataset, timeout=timeout).result()
        except BatchwireError as exc:
            if exc.code not in RETRIABLE:
                raise
            error = exc
            servers.mark_failed(server)
            continue
        pipeline = next((p for p in info.pipelines if p.name == spec.pipeline), None)
        if pipeline is None:
            known = ", ".join(p.name for p in info.pipelines)
            raise NotFoundError(
                f"server {server.address} has no pipeline {spec.pipeline!r} (it has: {known})"
            )
        try:
            check_params(spec.pipeline, spec.params, announced_ranges(pipeline))
            check_batch_size(spec.batch_size, info.max_batch_size)
        except ValueError as exc:
            raise InvalidArgumentError(f"{server.address}: {exc}") from None
        return info
    assert error is not None
    raise error


def find_workers(transport: Transport, servers: ServerSet, dataset: str, *, timeout: float) -> None:
    """Ask each server not yet asked whether it is a unit of workers (``batchwire serve
    --workers N``): one that announces its workers' own ports is replaced in ``servers``
    by those of them that answer from here, so that a pass pulls from every worker rather
    than from the one the unit's port hands this process's connection to. Where none
    answers (a firewall, a container that publishes the unit's port alone), the unit's
    own address is kept, with a warning once. A server that does not answer now is
    taken as it is."""
    for server in servers.unexplored():
        host = host_of(server.address)
        if host is None:
            servers.expand(server, ())  # a gRPC target (unix:, ipv4:) names no host to reuse
            continue
        try:
            info = transport.describe(server, dataset, timeout=timeout).result()
        except BatchwireError:
            servers.expand(server, ())
            continue
        workers = [Server(f"{host}:{port}", server.tls_name) for port in info.worker_ports]
        calls = [transport.describe(w, dataset, timeout=timeout) for w in workers]
        reached, missed = [], []
        for worker, call in zip(workers, calls, strict=True):
            try:
                call.result()
                reached.append(worker)
            except BatchwireError as exc:
                missed.append(f"{worker.address} ({rpc_details(exc)})")
        servers.expand(server, reached)
        if missed:
            log.warning(
                "%s is a unit of %d workers, and %s did not answer from here: %s; open "
                "the workers' own ports (batchwire serve --worker-port) to this host to pull "
                "from every worker",
                server.address,
                len(workers),
                ", ".join(missed),
                "this process pulls from the others"
                if reached
                else "this process pulls through the unit's port, from the worker it hands "
                "this connection to",
            )


def announced_ranges(pipeline: pb.PipelineInfo) -> dict[str, ParamRange]:
    """The ranges of ``pipeline``'s parameters as its server announces them; a server that
    names a parameter without its range (an older one) leaves only finite values checked."""
    unknown = ParamRange(low=-math.inf, high=math.inf)
    return {
        name: ParamRange.from_proto(pipeline.param_ranges[name])
        if name in pipeline.param_ranges
        else unknown
        for name in pipeline.params
    }
