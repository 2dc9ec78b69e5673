"""A mixture of datasets streamed by a real server (CPU DALI, LMDB datasets built here):
the set proportions, each rank's disjoint share, exact resume (also on another world
size), and bad input refused before any stream.

Three datasets of 80, 40 and 12 samples mixed 0.5/0.3/0.2 over an epoch of their sizes
added up (132): 66 of the first (a different subset each epoch), all 40 of the second,
26 of the third (each sample twice or three times).
"""

from __future__ import annotations

import collections
import pathlib
import pickle
import signal
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch.utils.data
from conftest import start_server
from PIL import Image
from processes import serve_process
from test_fairness import batches_taken_together
from test_metrics import settled, value
from test_preview import expected_strip, tiles

from batchwire.cli import main
from batchwire.client import InvalidArgumentError, Mixture, NotFoundError, RemoteLoader
from batchwire.common.mixture import mixture_counts, mixture_order
from batchwire.common.stream import Source, StreamSpec
from batchwire.server import BatchwireServer, ServerConfig
from batchwire.server.data import ingest, write_image_folders
from batchwire.server.engine import Engine
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc

SIZES = {"big": 80, "mid": 40, "small": 12}  # 4 classes each: 20, 10 and 3 a class
WEIGHTS = {"big": 0.5, "mid": 0.3, "small": 0.2}
COUNTS = (66, 40, 26)
SEED = 3

OPTIONS: dict[str, Any] = {
    "dataset": Mixture(WEIGHTS),
    "pipeline": "val",
    "params": {"size": 32},
    "return_ids": True,
    "seed": SEED,
    "batch_size": 8,
}


def datasets_of(
    sizes: dict[str, int], root: pathlib.Path, *, image: int = 48, shard: int = 32
) -> pathlib.Path:
    """A data directory under ``root`` of a dataset of each of ``sizes`` (4 classes each,
    images of ``image`` pixels, each dataset's own): its path."""
    for seed, (name, size) in enumerate(sizes.items()):
        write_image_folders(root / name, per_class=size // 4, size=image, seed=seed)
        ingest(root / name, root / "datasets", name=name, shard_size=shard)
    return root / "datasets"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return datasets_of(SIZES, tmp_path_factory.mktemp("mixture"))


@pytest.fixture(scope="module")
def server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    server = start_server(data_dir, metrics_port=0)
    yield server
    server.stop(grace=1.0)


def make(server: BatchwireServer, **kwargs: Any) -> RemoteLoader:
    return RemoteLoader(server.target, **{**OPTIONS, **kwargs})


def ids_of(loader: RemoteLoader, batches: int | None = None) -> list[int]:
    """The mixed ids of the next ``batches`` batches of a pass (all if None)."""
    taken: list[int] = []
    for count, (_, _, ids) in enumerate(loader, start=1):
        taken += ids.tolist()
        if count == batches:
            break
    return taken


@pytest.mark.slow
def test_each_epoch_holds_the_weights_share_of_each_source(server: BatchwireServer) -> None:
    loader = make(server, drop_last=False, batch_size=32)
    assert loader.source_counts == dict(zip(SIZES, COUNTS, strict=True))
    assert len(loader) == 5 and loader.num_samples == sum(COUNTS)
    sizes = tuple(SIZES.values())
    totals = collections.Counter[int]()
    labels_checked = 0
    for epoch in range(20):
        loader.set_epoch(epoch)
        epoch_ids: list[int] = []
        for images, labels, ids in loader:
            assert images.shape[1:] == (3, 32, 32)
            sources, local = loader.split_ids(ids)
            # Each sample's label is its source's own: ingest numbers a dataset's samples
            # class by class, so the label follows from the id within the source.
            per_class = np.array(sizes)[sources.numpy()] // 4
            assert (labels.numpy() == local.numpy() // per_class).all()
            labels_checked += len(ids)
            epoch_ids += ids.tolist()
        # The server's order is the mixture's, computed here from (seed, epoch, sizes,
        # counts) alone.
        assert epoch_ids == mixture_order(SEED, epoch, sizes, COUNTS).tolist()
        sources, local = loader.split_ids(epoch_ids)
        per_source = collections.Counter(sources.tolist())
        assert [per_source[s] for s in range(3)] == list(COUNTS)
        totals.update(per_source)
        for source, (size, count) in enumerate(zip(sizes, COUNTS, strict=True)):
            taken = local[sources == source].tolist()
            if count <= size:  # no sample twice within an epoch
                assert len(set(taken)) == count
            else:  # every sample, each count // size times or once more
                assert set(collections.Counter(taken).values()) <= {
                    count // size,
                    count // size + 1,
                }
                assert len(set(taken)) == size
    assert labels_checked == 20 * sum(COUNTS)
    # The server counts each source's samples and the batches that held some: those of
    # the 20 epochs, and of the first batches of epoch 20 that the loader asked for ahead
    # as epoch 19 ended.
    loader.close()
    metrics = settled(server)
    mixture = {"dataset": "big+mid+small", "pipeline": "val"}
    sent = value(metrics, "batchwire_samples_sent_total", **mixture) - 20 * sum(COUNTS)
    assert sent in (0, 32, 64)
    ahead = loader.split_ids(mixture_order(SEED, 20, sizes, COUNTS)[: int(sent)])[0]
    for source, (name, count) in enumerate(zip(SIZES, COUNTS, strict=True)):
        labels = {"dataset": name, "pipeline": "val"}
        samples = 20 * count + int((ahead == source).sum())
        assert value(metrics, "batchwire_mixture_samples_sent_total", **labels) == samples
        assert 0 < value(metrics, "batchwire_mixture_batches_sent_total", **labels) <= 20 * 5 + 2
    # 20 epochs: each source's share is its weight's, well within a binomial tolerance
    # (the counts are exact each epoch).
    total = sum(totals.values())
    for source, weight in enumerate(WEIGHTS.values()):
        spread = 3 * (total * weight * (1 - weight)) ** 0.5
        assert abs(totals[source] - weight * total) <= spread


def test_ranks_split_the_mixture_and_a_state_resumes_exactly_the_rest(
    server: BatchwireServer,
) -> None:
    ranks = [make(server, rank=r, world_size=2) for r in range(2)]
    shares = [ids_of(loader) for loader in ranks]
    # Each rank's share is its positions of the epoch, as the contract splits them.
    sources = tuple(Source(name, count) for name, count in zip(SIZES, COUNTS, strict=True))
    for rank, share in enumerate(shares):
        plan = StreamSpec(
            sources=sources, batch_size=8, seed=SEED, rank=rank, world_size=2, drop_last=False
        ).plan(list(SIZES.values()))
        planned = [i for k in range(plan.num_batches) for i in plan.batch(k).ids.tolist()]
        assert share == planned
    assert len(shares[0]) == len(shares[1]) == 66  # 8 batches of 8 and one of 2 each
    # Together, the epoch's positions once each (an id of the upsampled source comes as
    # often as the epoch holds it): every position, none on both ranks.
    order = mixture_order(SEED, 0, tuple(SIZES.values()), COUNTS).tolist()
    assert collections.Counter(shares[0] + shares[1]) == collections.Counter(order)
    for at in (1, 5):
        loader = make(server, rank=1, world_size=2)
        before = ids_of(loader, at)
        state = loader.state_dict()
        assert state["sources"] == [
            [name, count, info]
            for (name, count), info in zip(
                zip(SIZES, COUNTS, strict=True),
                [s.version for s in loader._describe().sources],
                strict=True,
            )
        ]
        resumed = make(server, rank=1, world_size=2)
        resumed.load_state_dict(state)
        assert before + ids_of(resumed) == shares[1]


def global_steps(loaders: list[RemoteLoader], steps: int) -> tuple[list[int], list[Any]]:
    """The ids of the first ``steps`` global steps of ``loaders`` (one a rank, a batch each
    a step), and their passes, left running."""
    passes = [iter(loader) for loader in loaders]
    ids = [i for _ in range(steps) for p in passes for i in next(p)[2].tolist()]
    return ids, passes


@pytest.mark.slow
def test_a_mixture_saved_on_two_ranks_resumes_exactly_on_three(server: BatchwireServer) -> None:
    order = mixture_order(SEED, 0, tuple(SIZES.values()), COUNTS).tolist()
    two = [make(server, rank=r, world_size=2, drop_last=False) for r in range(2)]
    consumed, _passes = global_steps(two, 3)
    state = two[0].state_dict()
    assert state["position"] == 48
    rest: list[int] = []
    for rank in range(3):
        loader = make(server, rank=rank, world_size=3, drop_last=False)
        loader.load_state_dict(state)
        rest += ids_of(loader)
    assert sorted(consumed) == sorted(order[:48])
    assert sorted(rest) == sorted(order[48:])  # nothing lost, nothing repeated


def test_bad_mixtures_are_refused_before_any_stream(server: BatchwireServer) -> None:
    for weights, words in (
        ({"big": 0.5, "mid": -0.1}, "finite numbers >= 0"),
        ({"big": 0, "mid": 0}, "at least one weight must be above 0"),
        ({"big": float("nan"), "mid": 1}, "finite numbers >= 0"),
        ({"big": 1, "no such!": 1}, "not a valid name"),
    ):
        with pytest.raises(InvalidArgumentError, match=words):
            Mixture(weights)
    with pytest.raises(InvalidArgumentError, match="one of"):
        Mixture(WEIGHTS, length="longest")
    with pytest.raises(InvalidArgumentError, match="weights or counts"):
        Mixture(WEIGHTS, counts={"big": 1})
    with pytest.raises(NotFoundError, match="missing"):
        len(make(server, dataset=Mixture({"big": 1, "missing": 1})))
    # On the wire, in the server's words: before any batch.
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.BatchwireStub(channel)

        def refused(*sources: pb.Source, dataset: str = "") -> grpc.RpcError:
            request = pb.StreamBatchesRequest(
                dataset=dataset, pipeline="val", batch_size=4, sources=sources
            )
            with pytest.raises(grpc.RpcError) as caught:
                next(iter(stub.StreamBatches(request, timeout=60)))
            return caught.value

        error = refused(pb.Source(dataset="big", count=4), pb.Source(dataset="big", count=4))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "named more than once" in str(error.details())
        error = refused(pb.Source(dataset="big", count=4), dataset="mid")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "leave dataset and dataset_version empty" in str(error.details())
        error = refused(pb.Source(dataset="big", count=4), pb.Source(dataset="gone", count=4))
        assert error.code() == grpc.StatusCode.NOT_FOUND
        error = refused(pb.Source(dataset="big", count=4, version="abc123"))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "version abc123 of dataset 'big'" in str(error.details())
        # An epoch of many times the data is refused before its order is made.
        error = refused(pb.Source(dataset="big", count=1 << 30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than 4 times its datasets' 80 samples" in str(error.details())
        error = refused(pb.Source(dataset="big", count=0))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "1 to" in str(error.details())


def test_a_server_sigkilled_mid_mixture_loses_and_repeats_nothing(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    expected = mixture_order(SEED, 0, tuple(SIZES.values()), COUNTS).tolist()
    with (
        serve_process(data_dir, tmp_path / "a.log") as a,
        serve_process(data_dir, tmp_path / "b.log") as b,
    ):
        loader = RemoteLoader(
            [a.address, b.address], **{**OPTIONS, "drop_last": False, "retry_timeout": 30}
        )
        ids: list[int] = []
        with loader:
            for n, (_, _, batch_ids) in enumerate(loader):
                ids += batch_ids.tolist()
                if n == 5:
                    a.process.send_signal(signal.SIGKILL)
        assert a.process.wait(10) == -signal.SIGKILL
    assert ids == expected  # the same samples, in the same order, as an undisturbed epoch


def check_grid(out: pathlib.Path, server: BatchwireServer, mixture: Mixture) -> list[int]:
    """Check the grid ``preview`` drew at ``out`` of the first batch of 6 of ``mixture``
    (seed 3, 48 pixels): each tile's caption says its dataset, and its label in that
    dataset's classes. The batch's sources."""
    with RemoteLoader(
        server.target,
        dataset=mixture,
        pipeline="val",
        batch_size=6,
        seed=3,
        drop_last=False,
        normalize=False,
        params={"size": 48, "resize": 56},
        return_ids=True,
    ) as loader:
        _, labels, ids = next(iter(loader))
        sources: list[int] = loader.split_ids(ids)[0].tolist()
    with Image.open(out) as png:
        grid = np.asarray(png.convert("RGB"))
    classes = ("circle", "cross", "square", "triangle")
    for (_, strip), label, source in zip(tiles(grid, 6, 3), labels.tolist(), sources, strict=True):
        text = f"{mixture.names[source]}: {label} {classes[label]}"
        assert np.array_equal(strip, expected_strip(text, 96)), f"caption is not {text!r}"
    return sources


@pytest.mark.slow
def test_preview_and_bench_take_a_mixture(
    server: BatchwireServer, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "grid.png"
    preview = ["preview", "--address", server.target, "--pipeline", "val", "--out", str(out)]
    shown = ["--batch-size", "6", "--seed", "3", "--param", "size=48", "--param", "resize=56"]
    assert main([*preview, "--dataset", "big=0.5,small=0.5", *shown]) == 0
    assert "6 images of 'big+small'" in capsys.readouterr().out
    sources = check_grid(out, server, Mixture({"big": 0.5, "small": 0.5}))
    assert len(set(sources)) == 2
    with pytest.raises(SystemExit) as refused:  # argparse's usage error
        main([*preview, "--dataset", "big=0.5,small=x", *shown])
    assert refused.value.code == 2
    assert "the weight must be a number" in capsys.readouterr().err

    bench = ["bench", "--address", server.target, "--pipeline", "val", "--no-progress"]
    sizes = ["--images", "32", "--batch-size", "16"]
    assert main([*bench, "--dataset", "big=0.7,mid=0.3", *sizes]) == 0
    assert "images/s" in capsys.readouterr().out
    assert main([*bench, "--dataset", "big=0.7,mid=-1", *sizes]) == 2
    assert "finite numbers >= 0" in capsys.readouterr().err


@pytest.mark.slow
def test_jobs_of_different_mixtures_share_a_server_fairly(data_dir: pathlib.Path) -> None:
    """Two jobs of other mixtures, a job of one of their datasets and a val pass of a
    mixture share one engine's pipelines: every stream gets a fair part."""
    engine = Engine(ServerConfig(data_dir=data_dir, device="cpu", num_threads=1))
    engine.open_datasets()
    sizes = dict(SIZES)

    def sources(**weights: float) -> tuple[Source, ...]:
        counts = mixture_counts([sizes[n] for n in weights], weights=list(weights.values()))
        return tuple(Source(n, c) for n, c in zip(weights, counts, strict=True))

    job = sources(big=0.5, mid=0.3, small=0.2)
    specs: list[dict[str, Any]] = [
        *[{"sources": job, "rank": rank, "world_size": 2} for rank in range(2)],
        {"sources": sources(mid=0.1, small=0.9)},
        {"dataset": "big"},
        {"sources": sources(big=0.5, small=0.5), "pipeline": "val"},
    ]
    streams = [
        engine.open_stream(
            StreamSpec(**spec, batch_size=4, params={"size": 32}, drop_last=False, seed=i)
        )
        for i, spec in enumerate(specs)
    ]
    try:
        counts = batches_taken_together(streams, 60, timeout=300)  # the least: 17 batches
    finally:
        engine.close()
    assert min(counts) * 4 >= max(counts), counts


@pytest.mark.slow
def test_a_mixtures_loader_pickles_for_spawned_workers(server: BatchwireServer) -> None:
    """A spawned DataLoader worker (and a rank of torch.multiprocessing.spawn) gets a
    pickled copy of the loader: a mixture's copy streams the mixture's epoch exactly."""
    loader = make(server, drop_last=False)
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.mixture == loader.mixture == Mixture(WEIGHTS)
    data = torch.utils.data.DataLoader(
        copy, batch_size=None, num_workers=1, multiprocessing_context="spawn"
    )
    ids = [i for _, _, batch in data for i in batch.tolist()]
    assert ids == mixture_order(SEED, 0, tuple(SIZES.values()), COUNTS).tolist()
