"""The transport runs of ``batchwire bench --compare``, in child processes of their own.

(d) ``transport``  batchwire's streaming path with batches already in memory
(e) ``raw``        the gRPC ceiling: plain messages of the same sizes

and, for ``python -m benchmarks --messages``, the ceiling under gRPC's: the same bytes
over a plain TCP connection (:func:`plain_server`, :func:`run_plain`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

from batchwire.bench._probe import CpuClock, RssSampler
from batchwire.bench._runs import IMAGE_BYTES, RunResult
from batchwire.common.bulk import receive_into

__all__ = [
    "IN_MEMORY_BYTES",
    "plain_server",
    "raw_server",
    "run_plain",
    "run_raw",
    "transport_server",
]

# What the transport (d) and raw (e) servers hold in memory and cycle through: far
# more than a CPU cache, as a real stream's data is.
IN_MEMORY_BYTES = 1024 * IMAGE_BYTES


class _InMemoryBatches:
    """The handlers of a server with batchwire's streaming path (batch encoding, parts,
    grpc.aio on uvloop) whose batches are already in memory: what is left of a stream
    when decoding costs nothing."""

    def __init__(self, dataset: str, num_samples: int, size: int, limit: int) -> None:
        import numpy as np

        from batchwire.v1 import batchwire_pb2 as pb

        self.images = np.random.default_rng(0).integers(
            0, 255, (IN_MEMORY_BYTES // (3 * size * size), 3, size, size), dtype=np.uint8
        )
        self.info = pb.DatasetInfo(
            name=dataset,
            num_samples=num_samples,
            pipelines=[pb.PipelineInfo(name="transport", mean=[0, 0, 0], std=[1, 1, 1])],
        )
        self.num_samples, self.limit, self.offset = num_samples, limit, 0

    async def describe(self, request: Any, context: Any) -> Any:
        return self.info

    def _encoded(self, plan: Any, index: int) -> list[bytes]:
        import numpy as np

        from batchwire.server.engine import Batch
        from batchwire.server.serving import encode_parts

        planned = plan.batch(index)
        n = len(planned.ids)
        start = 0 if self.offset + n > len(self.images) else self.offset  # cycle through all
        self.offset = start + n
        batch = Batch(
            index=planned.index,
            ids=planned.ids,
            images=self.images[start : start + n],
            labels=np.zeros(n, np.int64),
            cursor=planned.end,
            skipped_ids=(),
            normalized=False,
            num_batches=plan.num_batches,
            layout="NCHW",
        )
        return encode_parts(batch, self.limit).messages

    async def stream(self, request: Any, context: Any) -> Any:
        from batchwire.common.stream import StreamSpec

        plan = StreamSpec.from_proto(request).plan(self.num_samples)
        loop = asyncio.get_running_loop()
        for planned in plan.batches():
            for message in await loop.run_in_executor(None, self._encoded, plan, planned.index):
                yield message

    async def pull(self, requests: Any, context: Any) -> None:
        from batchwire.common.stream import StreamSpec

        loop = asyncio.get_running_loop()
        await context.send_initial_metadata(())
        plan = None
        async for message in requests:
            plan = plan or StreamSpec.from_proto(message.stream).plan(self.num_samples)
            for index in message.batches:
                for part in await loop.run_in_executor(None, self._encoded, plan, index):
                    await context.write(part)


def _transport_server(
    port_queue: Any, dataset: str, num_samples: int, size: int, limit: int
) -> None:
    import grpc

    from batchwire.server.serving import tune_for_large_buffers
    from batchwire.v1 import batchwire_pb2 as pb

    tune_for_large_buffers()  # as `batchwire serve` does
    batches = _InMemoryBatches(dataset, num_samples, size, limit)
    handlers = {
        "DescribeDataset": grpc.unary_unary_rpc_method_handler(
            batches.describe,
            request_deserializer=pb.DescribeDatasetRequest.FromString,
            response_serializer=pb.DatasetInfo.SerializeToString,
        ),
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            batches.stream, request_deserializer=pb.StreamBatchesRequest.FromString
        ),
        "PullBatches": grpc.stream_stream_rpc_method_handler(
            batches.pull, request_deserializer=pb.PullRequest.FromString
        ),
    }

    async def main() -> None:
        server = grpc.aio.server(
            options=[("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)]
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("batchwire.v1.Batchwire", handlers),)
        )
        port_queue.put(server.add_insecure_port("localhost:0"))
        await server.start()
        await server.wait_for_termination()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


@contextlib.contextmanager
def transport_server(
    dataset: str, num_samples: int, size: int = 224, max_message_bytes: int | None = None
) -> Iterator[tuple[str, int]]:
    """(address, pid) of a :func:`_transport_server` in a child process."""
    from batchwire.server import ServerConfig

    limit = max_message_bytes or ServerConfig.max_message_bytes
    with _child(_transport_server, dataset, num_samples, size, limit) as served:
        yield served


@contextlib.contextmanager
def _child(target: Callable[..., None], *args: Any) -> Iterator[tuple[str, int]]:
    context = multiprocessing.get_context("spawn")
    port_queue = context.Queue()
    process = context.Process(target=target, args=(port_queue, *args), daemon=True)
    process.start()
    try:
        port = port_queue.get(timeout=120)
        yield f"localhost:{port}", process.pid  # type: ignore[misc]
    finally:
        process.terminate()
        process.join(10)


# -- (e) raw gRPC ceiling --------------------------------------------------------------


def _raw_server(port_queue: Any, message_bytes: int) -> None:
    import grpc

    from batchwire.server.serving import tune_for_large_buffers

    tune_for_large_buffers()  # the same allocator settings as the batchwire servers

    # As many distinct bytes as the transport server's batches in memory, cycled: one
    # payload sent again and again would be read from the CPU's cache, which no
    # real stream enjoys.
    payloads = [
        os.urandom(message_bytes) for _ in range(max(1, -(-IN_MEMORY_BYTES // message_bytes)))
    ]

    def stream(request: bytes, context: Any) -> Iterator[bytes]:
        for i in range(int.from_bytes(request, "little")):
            yield payloads[i % len(payloads)]

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        options=[("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)],
    )
    server.add_generic_rpc_handlers((handler,))
    port_queue.put(server.add_insecure_port("localhost:0"))
    server.start()
    server.wait_for_termination()


@contextlib.contextmanager
def raw_server(message_bytes: int) -> Iterator[tuple[str, int]]:
    """A plain gRPC server streaming ``message_bytes``-byte messages; (address, pid)."""
    with _child(_raw_server, message_bytes) as served:
        yield served


def run_raw(
    address: str, server_pid: int, message_bytes: int, images_per_message: float, images: int
) -> RunResult:
    import grpc

    messages = max(1, math.ceil(images / images_per_message))
    with grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", -1)]
    ) as channel:
        stream = channel.unary_stream("/bench.Raw/Stream")
        list(stream((1).to_bytes(4, "little")))  # connect
        server_cpu = CpuClock(server_pid)
        cpu = CpuClock()
        received = 0
        with RssSampler(os.getpid(), server_pid) as rss:
            started = time.perf_counter()
            for message in stream(messages.to_bytes(4, "little")):
                received += len(message)
            seconds = time.perf_counter() - started
    done = round(messages * images_per_message)
    return RunResult(
        "raw", done, seconds, cpu.seconds(), server_cpu.seconds(), rss.peaks[0], rss.peaks[1]
    )


# -- the ceiling under gRPC: a plain TCP connection -------------------------------------

_COUNT = struct.Struct("<Q")


def _plain_server(port_queue: Any, message_bytes: int) -> None:
    """Per connection: a count, then that many ``message_bytes`` messages, each sent from
    the payload's own memory (``sendall`` of a memoryview: no copy in this process, the
    interpreter lock let go while the kernel copies)."""
    payloads = [
        memoryview(os.urandom(message_bytes))
        for _ in range(max(1, -(-IN_MEMORY_BYTES // message_bytes)))
    ]
    listener = socket.create_server(("localhost", 0))
    port_queue.put(listener.getsockname()[1])
    while True:
        connection, _ = listener.accept()
        with connection:
            (count,) = _COUNT.unpack(_receive_exactly(connection, _COUNT.size))
            for i in range(count):
                connection.sendall(payloads[i % len(payloads)])


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    receive_into(connection, memoryview(data))
    return bytes(data)


@contextlib.contextmanager
def plain_server(message_bytes: int) -> Iterator[tuple[str, int]]:
    """A server streaming ``message_bytes``-byte messages over plain TCP; (address, pid)."""
    with _child(_plain_server, message_bytes) as served:
        yield served


def run_plain(address: str, server_pid: int, message_bytes: int, messages: int) -> RunResult:
    """``messages`` messages from a :func:`plain_server`, each received into one buffer
    (``recv_into``: the kernel's copy only), as a client that reuses its batch memory."""
    host, port = address.rsplit(":", 1)
    buffer = memoryview(bytearray(message_bytes))
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(_COUNT.pack(1))  # connect and warm up, as run_raw does
        receive_into(connection, buffer)
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        server_cpu = CpuClock(server_pid)
        cpu = CpuClock()
        with RssSampler(os.getpid(), server_pid) as rss:
            started = time.perf_counter()
            connection.sendall(_COUNT.pack(messages))
            for _ in range(messages):
                receive_into(connection, buffer)
            seconds = time.perf_counter() - started
    return RunResult(
        "plain", messages, seconds, cpu.seconds(), server_cpu.seconds(), rss.peaks[0], rss.peaks[1]
    )
