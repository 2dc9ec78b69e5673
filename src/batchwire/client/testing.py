"""Test code that trains on a ``RemoteLoader`` without a server: a transport that answers
the loader's calls in this process, as httpx's ``MockTransport`` answers a client's.

    from batchwire.client import RemoteLoader
    from batchwire.client.testing import MockTransport

    transport = MockTransport.serving("pets", num_samples=100, classes=("cat", "dog"))
    with RemoteLoader("mock:1", dataset="pets", batch_size=8, transport=transport) as loader:
        for images, labels in loader:  # 13 batches an epoch, in the order of (seed, epoch)
            ...

``MockTransport.serving`` answers as a server of a dataset of ``num_samples`` samples
would: every batch a pass asks for, with the ids of the epoch's order for its seed, rank
and world size, cursors and ``len(loader)`` as a server gives them, so that
``state_dict``/``load_state_dict``, ranks and epochs behave as they do against a server.
Sample ``i``'s image is filled with ``i % 256`` and its label is ``i % len(classes)``.

``MockTransport(handler, datasets)`` is the general form: ``handler(call)`` answers each
``PullBatches`` call, run in a thread of the call's own as a server's handler runs: it
reads ``call.requests`` (the pass's ``PullRequest`` messages) and yields ``Batch``
messages as bytes (:func:`batch_message`), or raises the ``BatchwireError`` the call ends
with (``UnavailableError`` for a server that fails: the loader asks another). Every call
made is kept in ``transport.calls``. The mock never imports grpc and serves no shared
memory or bulk connection: batches come in the messages, as from a server on another host.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from batchwire.client._transport import (
    BatchwireError,
    Claim,
    InvalidArgumentError,
    NotFoundError,
    PullOptions,
    Server,
    StatusCode,
    UnavailableError,
)
from batchwire.common.batch_codec import DecodedBatch, decode_batch, encode_batch
from batchwire.common.sampler import Plan
from batchwire.common.stream import StreamSpec
from batchwire.common.tensors import to_proto
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["Handler", "MockCall", "MockTransport", "batch_message", "dataset_info"]

_END = object()  # the handler returned: the server ended the call
_GUARD_S = 60.0  # how long a call waits for its handler's next message: a hang guard
# The presets' statistics (ImageNet's, 0..255 scale), which a loader normalizes with.
_MEAN = (123.675, 116.28, 103.53)
_STD = (58.395, 57.12, 57.375)

# What answers a mock server's PullBatches calls (see the module).
Handler = Callable[["MockCall"], Iterable[bytes]]


def batch_message(
    index: int,
    ids: Sequence[int],
    cursor: int,
    *,
    num_batches: int = 0,
    classes: int = 10,
    image_shape: tuple[int, int, int] = (3, 8, 8),
) -> bytes:
    """Batch ``index`` as a server sends it: samples ``ids``, sample ``i``'s image (uint8
    ``image_shape``, CHW) filled with ``i % 256``, its label ``i % classes``, and the
    share's cursor after the batch."""
    samples = np.asarray(ids, dtype=np.int64)
    header = pb.Batch(
        index=index,
        ids=samples.tolist(),
        labels=to_proto("labels", samples % max(classes, 1), "N"),
        cursor=cursor,
        num_batches=num_batches,
    )
    images = np.empty((len(samples), *image_shape), np.uint8)
    images[:] = (samples % 256).astype(np.uint8).reshape(-1, 1, 1, 1)
    return encode_batch(header, images, "NCHW")


def dataset_info(
    name: str,
    num_samples: int,
    classes: Sequence[str] = (),
    pipelines: Sequence[str] = ("train", "val"),
) -> pb.DatasetInfo:
    """A server's description of dataset ``name``: its size, classes, and ``pipelines``
    of one image output normalized with ImageNet's statistics, as the presets are."""
    return pb.DatasetInfo(
        name=name,
        num_samples=num_samples,
        classes=list(classes),
        pipelines=[pb.PipelineInfo(name=p, mean=_MEAN, std=_STD) for p in pipelines],
        # As a server's: 12 hex digits, here of the dataset's name and size.
        version=hashlib.sha256(f"{name}:{num_samples}".encode()).hexdigest()[:12],
    )


class MockCall:
    """One ``PullBatches`` call to a mock server (a ``PullCall``)."""

    def __init__(
        self,
        server: Server,
        requests: Iterator[pb.PullRequest],
        handler: Handler,
        options: PullOptions | None = None,
    ):
        self.server = server
        self.options = options or PullOptions()  # what the pass offered (none is taken)
        self.read: list[pb.PullRequest] = []  # the requests the handler read
        self.cancelled = threading.Event()
        self.ended = threading.Event()  # the handler returned or raised
        self.cancelled_while_open = False
        self._requests = requests
        self._out: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(
            target=self._serve, args=(handler,), name=f"mock-{server.address}", daemon=True
        )

    @property
    def requests(self) -> Iterator[pb.PullRequest]:
        """The pass's request stream, as the handler reads it (each one kept in ``read``)."""
        for request in self._requests:
            self.read.append(request)
            yield request

    def asked(self) -> list[int]:
        """The batches the requests read so far asked for, in order."""
        return [index for request in self.read for index in request.batches]

    def _serve(self, handler: Handler) -> None:
        try:
            for message in handler(self):
                if self.cancelled.is_set():
                    return
                self._out.put(message)
            self._out.put(_END)
        except BatchwireError as exc:
            self._out.put(exc)
        except Exception as exc:  # the handler's own bug: the call fails, it does not hang
            self._out.put(
                BatchwireError(f"mock server's handler raised {exc!r}", code=StatusCode.INTERNAL)
            )
        finally:
            self.ended.set()

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float = _GUARD_S) -> None:
        self._thread.join(timeout)

    def __enter__(self) -> MockCall:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None  # what the call raises is a BatchwireError already

    def __iter__(self) -> Iterator[DecodedBatch]:
        while True:
            try:
                item = self._out.get(timeout=_GUARD_S)
            except queue.Empty:
                raise UnavailableError(
                    f"mock server {self.server.address}: its handler sent nothing for "
                    f"{_GUARD_S:g} s"
                ) from None
            if item is _END:
                return
            if isinstance(item, BatchwireError):
                raise item
            assert isinstance(item, bytes)
            yield decode_batch(item)

    def read_images(self, out: np.ndarray) -> None:
        raise BatchwireError(
            "a mock server sends every batch in its messages, none on a bulk connection",
            code=StatusCode.INTERNAL,
        )

    def cancel(self) -> None:
        self.cancelled_while_open = self.cancelled_while_open or not self.ended.is_set()
        self.cancelled.set()
        self._out.put(BatchwireError("the call was cancelled", code=StatusCode.CANCELLED))


class _Answered:
    """A unary call that already has its answer (a ``Pending``)."""

    def __init__(self, answer: Callable[[], object]) -> None:
        self._answer = answer

    def result(self) -> object:
        return self._answer()

    def cancel(self) -> None:
        pass


class MockTransport:
    """A ``Transport`` whose servers are ``handler`` (one for all; it sees
    ``call.server``); ``describe`` knows the datasets in ``datasets``. Pass it to
    ``RemoteLoader(..., transport=...)``; the loader's addresses name its servers."""

    def __init__(
        self, handler: Handler, datasets: Mapping[str, pb.DatasetInfo] | None = None
    ) -> None:
        self.handler = handler
        self.datasets = dict(datasets or {})
        self.calls: list[MockCall] = []
        self._lock = threading.Lock()

    @classmethod
    def serving(
        cls,
        dataset: str,
        num_samples: int,
        *,
        classes: Sequence[str] = ("a", "b"),
        image_shape: tuple[int, int, int] = (3, 8, 8),
        pipelines: Sequence[str] = ("train", "val"),
    ) -> MockTransport:
        """Servers of ``dataset``, ``num_samples`` samples of ``classes``, that answer
        every batch a pass asks for as a server would (see the module)."""
        serve = _DatasetServer(num_samples, len(classes), image_shape)
        return cls(serve, {dataset: dataset_info(dataset, num_samples, classes, pipelines)})

    def open_pull(
        self, server: Server, stream: pb.StreamBatchesRequest, claim: Claim, options: PullOptions
    ) -> MockCall:
        call = MockCall(server, _requests(stream, claim), self.handler, options)
        with self._lock:
            self.calls.append(call)
        call.start()
        return call

    def calls_to(self, address: str) -> list[MockCall]:
        """The calls made to the server at ``address``, in the order opened."""
        with self._lock:
            return [call for call in self.calls if call.server.address == address]

    def describe(self, server: Server, dataset: str, *, timeout: float) -> _Answered:
        def answer() -> pb.DatasetInfo:
            if dataset not in self.datasets:
                raise NotFoundError(f"server {server.address}: no dataset {dataset!r}")
            return self.datasets[dataset]

        return _Answered(answer)

    def preprocess(
        self, server: Server, request: pb.PreprocessRequest, *, timeout: float
    ) -> _Answered:
        def answer() -> pb.PreprocessResponse:
            raise UnavailableError(f"mock server {server.address} preprocesses nothing")

        return _Answered(answer)

    def close(self) -> None:
        pass

    def __getstate__(self) -> dict[str, object]:
        """A copy for a spawned DataLoader worker: its handler and datasets, no calls."""
        return {"handler": self.handler, "datasets": self.datasets}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["handler"], state["datasets"])  # type: ignore[misc]


def _requests(stream: pb.StreamBatchesRequest, claim: Claim) -> Iterator[pb.PullRequest]:
    """A pass's request stream, as a server on another host reads it: the stream and the
    first batches, then batches as the pass has room, until it asks for no more."""
    yield pb.PullRequest(stream=stream, batches=claim(False) or ())
    while (batches := claim(True)) is not None:
        yield pb.PullRequest(batches=batches)


class _DatasetServer:
    """``MockTransport.serving``'s handler: each batch asked for, from the plan of the
    call's stream (its first request), in the order asked."""

    def __init__(self, num_samples: int, classes: int, image_shape: tuple[int, int, int]):
        self.num_samples = num_samples
        self.classes = classes
        self.image_shape = image_shape

    def __call__(self, call: MockCall) -> Iterator[bytes]:
        plan: Plan | None = None
        for request in call.requests:
            if request.HasField("stream"):
                plan = StreamSpec.from_proto(request.stream).plan(self.num_samples)
            assert plan is not None, "a pass's first request names its stream"
            for index in request.batches:
                try:
                    planned = plan.batch(int(index))
                except ValueError as exc:  # as a server refuses it
                    raise InvalidArgumentError(str(exc)) from None
                yield batch_message(
                    planned.index,
                    planned.ids.tolist(),
                    planned.end,
                    num_batches=plan.num_batches,
                    classes=self.classes,
                    image_shape=self.image_shape,
                )
