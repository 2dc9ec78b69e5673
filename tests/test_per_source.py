"""Per-source batching: a mixture whose every batch comes from one source, the sources at
different image sizes (and on different servers), with a real server (CPU DALI) over
LMDB datasets built here.

Two datasets, "big" of 48 samples and "small" of 16, mixed 0.75/0.25 over an epoch of
their sizes added up: 48 and 16 samples, 12 and 4 batches of 4 on one rank. "big" comes
at 32 px, "small" at 24 px.
"""

from __future__ import annotations

import collections
import pathlib
import pickle
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import start_server
from processes import Target, in_trainer_process, serve_process
from test_frameworks import stateful_resume
from test_metrics import settled, value
from test_mixture_streaming import check_grid, datasets_of, global_steps
from torchdata.stateful_dataloader import StatefulDataLoader

from batchwire.cli import main
from batchwire.client import InvalidArgumentError, Mixture, NotFoundError, RemoteLoader
from batchwire.common.mixture import batch_schedule, mixture_order, source_seed
from batchwire.server import BatchwireServer

SIZES = {"big": 48, "small": 16}  # 4 classes each
PX = {"big": 32, "small": 24}
SEED = 5
BATCH = 4

MIXTURE = Mixture(
    {"big": 0.75, "small": 0.25},
    batching="per_source",
    per_source={"small": {"params": {"size": PX["small"]}}},
)
OPTIONS: dict[str, Any] = {
    "dataset": MIXTURE,
    "pipeline": "val",
    "params": {"size": PX["big"]},
    "return_ids": True,
    "seed": SEED,
    "batch_size": BATCH,
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return datasets_of(SIZES, tmp_path_factory.mktemp("per-source"), image=40, shard=16)


@pytest.fixture(scope="module")
def server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    server = start_server(data_dir)
    yield server
    server.stop(grace=1.0)


def make(server: BatchwireServer, **kwargs: Any) -> RemoteLoader:
    return RemoteLoader(server.target, **{**OPTIONS, **kwargs})


def take(
    loader: RemoteLoader, batches: int | None = None, px: dict[str, int] = PX
) -> list[tuple[int, list[int]]]:
    """(source, mixed ids) of the next ``batches`` batches of a pass (all if None), each
    batch checked to be of one source, at that source's size (``px``)."""
    taken = []
    for count, (images, labels, ids) in enumerate(loader, start=1):
        sources, _ = loader.split_ids(ids)
        source = int(sources[0])
        assert (sources == source).all(), "a batch of one source only"
        side = px[list(SIZES)[source]]
        assert images.shape == (len(ids), 3, side, side)
        assert len(labels) == len(ids)
        taken.append((source, ids.tolist()))
        if count == batches:
            break
    return taken


def expected_ids(source: int, epoch: int, repeat: int = 1) -> list[int]:
    """Source ``source``'s samples of an epoch (each ``repeat`` times), in order, as mixed
    ids: its own order (a mixture of itself alone, seeded for it)."""
    size = list(SIZES.values())[source]
    offset = sum(list(SIZES.values())[:source])
    order = mixture_order(source_seed(SEED, source), epoch, (size,), (size * repeat,))
    return (order + offset).tolist()


def test_each_batch_is_of_one_source_at_its_size_in_the_planned_order(
    server: BatchwireServer,
) -> None:
    loader = make(server)
    assert loader.source_counts == SIZES
    assert len(loader) == 16 and loader.num_samples == 64
    for epoch in range(2):
        taken = take(loader)
        # Which source each step takes from: the schedule, from (seed, epoch, batches).
        assert [s for s, _ in taken] == batch_schedule(SEED, epoch, [12, 4]).tolist()
        for source in range(2):
            ids = [i for s, batch in taken if s == source for i in batch]
            assert ids == expected_ids(source, epoch)  # each sample once, in its order
        assert loader.epoch == epoch + 1
    # A pickled copy (a spawned DataLoader worker's, a ddp_spawn rank's) streams the same.
    copy = pickle.loads(pickle.dumps(loader))
    copy.set_epoch(1)
    assert [ids for _, ids in take(copy)] == [ids for _, ids in taken]


def test_ranks_take_disjoint_shares_and_a_state_resumes_exactly_the_rest(
    server: BatchwireServer,
) -> None:
    ranks = [make(server, rank=r, world_size=2) for r in range(2)]
    shares = [take(loader) for loader in ranks]
    # Every step is of the same source on every rank (6 + 2 batches a rank).
    assert [s for s, _ in shares[0]] == [s for s, _ in shares[1]]
    assert [s for s, _ in shares[0]] == batch_schedule(SEED, 0, [6, 2]).tolist()
    together = [i for share in shares for _, batch in share for i in batch]
    assert sorted(together) == sorted(expected_ids(0, 0) + expected_ids(1, 0))
    for at in (1, 3, 6):
        loader = make(server, rank=1, world_size=2)
        before = take(loader, at)
        if at == 3:
            loader.close()  # the state still says where its pass stood (as after a with)
        state = loader.state_dict()
        assert state["batching"] == "per_source" and set(state["parts"]) == set(SIZES)
        resumed = make(server, rank=1, world_size=2)
        resumed.load_state_dict(state)
        assert before + take(resumed) == shares[1]
        assert resumed.epoch == 1


def test_a_state_saved_on_two_ranks_resumes_exactly_on_three(server: BatchwireServer) -> None:
    two = [make(server, rank=r, world_size=2, drop_last=False) for r in range(2)]
    consumed, _passes = global_steps(two, 3)
    state = two[0].state_dict()
    rest: list[int] = []
    steps = []
    for rank in range(3):
        loader = make(server, rank=rank, world_size=3, drop_last=False)
        loader.load_state_dict(state)
        taken = take(loader)
        steps.append([s for s, _ in taken])
        rest += [i for _, batch in taken for i in batch]
    assert steps[0] == steps[1] == steps[2]  # one source a step on every rank
    # Nothing lost, nothing repeated (ranks of a share that does not divide evenly are
    # padded from the start of their source's rest, as for one dataset).
    epoch = collections.Counter(expected_ids(0, 0) + expected_ids(1, 0))
    assert not epoch - collections.Counter(consumed + rest)
    assert set(consumed).isdisjoint(rest)


def test_sources_on_different_servers_and_pipelines(
    server: BatchwireServer, data_dir: pathlib.Path
) -> None:
    other = start_server(data_dir, metrics_port=0)
    try:
        mixture = Mixture(
            counts={"big": 8, "small": 24},  # small's 16 samples upsampled to 24
            batching="per_source",
            per_source={"small": {"address": other.target, "pipeline": "train"}},
        )
        loader = make(server, dataset=mixture, params={"size": 24})
        assert len(loader) == 8
        taken = take(loader, px={"big": 24, "small": 24})
        ids = [i for _, batch in taken for i in batch]
        small = collections.Counter(i - 48 for i in ids if i >= 48)
        assert sorted(small) == list(range(16)) and set(small.values()) == {1, 2}
        assert len([i for i in ids if i < 48]) == len(set(i for i in ids if i < 48)) == 8
        loader.close()
        # The other server made small's batches, through its own pipeline, and no others.
        metrics = settled(other)
        for name, pipeline, samples in (("small", "train", 24), ("big", "val", 0)):
            labels = {"dataset": name, "pipeline": pipeline}
            assert value(metrics, "batchwire_mixture_samples_sent_total", **labels) == samples
    finally:
        other.stop(grace=1.0)


def test_bad_per_source_settings_are_refused(server: BatchwireServer) -> None:
    weights = {"big": 0.5, "small": 0.5}
    for kwargs, words in (
        ({"batching": "stripes"}, "batching must be one of"),
        ({"per_source": {"small": {"params": {"size": 8}}}}, "batching='per_source'"),
        ({"batching": "per_source", "per_source": {"gone": {}}}, "not one of the mixture"),
        ({"batching": "per_source", "per_source": {"small": {"size": 8}}}, "may set only"),
        ({"batching": "per_source", "per_source": {"small": {"pipeline": "a b"}}}, "valid name"),
    ):
        with pytest.raises(InvalidArgumentError, match=words):
            Mixture(weights, **kwargs)
    with pytest.raises(InvalidArgumentError, match="params"):
        make(
            server,
            dataset=Mixture(
                weights,
                batching="per_source",
                per_source={"small": {"params": {"size": float("nan")}}},
            ),
        )
    # A dataset no server has: said before any stream, as for any mixture.
    for batching in ("per_source", "stratified"):
        with pytest.raises(NotFoundError, match="missing"):
            len(make(server, dataset=Mixture({"big": 1, "missing": 1}, batching=batching)))
    # A state of a mixture batched at random does not load into one batched per source.
    random = make(server, dataset=Mixture(weights))
    state = random.state_dict()
    with pytest.raises(InvalidArgumentError, match="batching"):
        make(server, dataset=Mixture(weights, batching="per_source")).load_state_dict(state)


@pytest.mark.parametrize("batching", ["per_source", "stratified"])
def test_a_server_sigkilled_mid_epoch_loses_and_repeats_nothing(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, batching: str
) -> None:
    # Each sample 3 times: 48 batches (stratified: of 3 of big and 1 of small), of which a
    # server holds a few at any time.
    per_source = {"small": {"params": {"size": PX["small"]}}} if batching == "per_source" else {}
    mixture = Mixture(counts={"big": 144, "small": 48}, batching=batching, per_source=per_source)
    with (
        serve_process(data_dir, tmp_path / "a.log") as a,
        serve_process(data_dir, tmp_path / "b.log") as b,
    ):
        loader = RemoteLoader(
            [a.address, b.address], **{**OPTIONS, "dataset": mixture, "retry_timeout": 30}
        )
        taken = []
        with loader:
            for n, (_, _, ids) in enumerate(loader):
                taken.append(ids.tolist())
                if n == 3:
                    a.process.send_signal(signal.SIGKILL)
        assert a.process.wait(10) == -signal.SIGKILL
    # The same batches, in the same order, as an undisturbed epoch.
    expected = [expected_ids(source, 0, repeat=3) for source in range(2)]
    if batching == "stratified":
        assert [i for batch in taken for i in batch[:3]] == expected[0]
        assert [batch[3] for batch in taken] == expected[1]
        return
    sources = [int(batch[0] >= SIZES["big"]) for batch in taken]
    assert sources == batch_schedule(SEED, 0, [36, 12]).tolist()
    for source in range(2):
        ids = [i for s, batch in zip(sources, taken, strict=True) if s == source for i in batch]
        assert ids == expected[source]


@pytest.mark.slow
def test_stateful_dataloader_workers_resume_a_per_source_mixture(
    server: BatchwireServer,
) -> None:
    """StatefulDataLoader with 2 workers (spawned, with a pickled copy of the loader): its
    state after 5 batches resumes a new one at the rest of the epoch, then the next."""
    whole = [ids for _, ids in take(make(server))]
    loader = make(server)
    loader.set_epoch(1)
    following = [ids for _, ids in take(loader)]
    in_trainer_process(stateful_workers_resume, Target(server.target), whole, following)


def stateful_workers_resume(server: Target, whole: list[Any], following: list[Any]) -> None:
    def loader() -> StatefulDataLoader:  # type: ignore[type-arg]
        remote = RemoteLoader(server.target, **OPTIONS)
        return StatefulDataLoader(remote, batch_size=None, num_workers=2)

    head, rest, after = stateful_resume(loader, 5)
    assert (head, rest, after) == (whole[:5], whole[5:], following)


def test_preview_and_bench_take_per_source_batching(
    server: BatchwireServer, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "grid.png"
    shown = ["--batch-size", "6", "--seed", "3", "--param", "size=48", "--param", "resize=56"]
    preview = ["preview", "--address", server.target, "--pipeline", "val", "--out", str(out)]
    mixed = ["--dataset", "big=0.75,small=0.25", "--batching", "per_source"]
    assert main([*preview, *mixed, *shown]) == 0
    # Every tile of one dataset, each caption saying it, and its label there.
    sources = check_grid(out, server, Mixture({"big": 0.75, "small": 0.25}, batching="per_source"))
    assert len(set(sources)) == 1
    capsys.readouterr()

    bench = ["bench", "--address", server.target, "--pipeline", "val", "--no-progress"]
    sizes = ["--images", "32", "--batch-size", "8"]
    assert main([*bench, *mixed, *sizes]) == 0
    assert "images/s" in capsys.readouterr().out
    assert main([*bench, "--dataset", "big", "--batching", "per_source", *sizes]) == 2
    assert "--batching per_source is for a mixture" in capsys.readouterr().err


STRATIFIED = Mixture({"big": 0.75, "small": 0.25}, batching="stratified")


def test_stratified_batches_hold_each_sources_share(server: BatchwireServer) -> None:
    # Batches of 8: 6 of big and 2 of small, 8 of them an epoch (48 / 6, 16 / 2).
    loader = make(server, dataset=STRATIFIED, batch_size=8, params={"size": 32})
    assert len(loader) == 8
    for epoch in range(2):
        taken = []
        for images, labels, ids in loader:
            assert images.shape == (8, 3, 32, 32) and len(labels) == 8
            assert loader.split_ids(ids)[0].tolist() == [0] * 6 + [1] * 2
            taken.append(ids.tolist())
        assert len(taken) == 8
        assert [i for batch in taken for i in batch[:6]] == expected_ids(0, epoch)
        assert [i for batch in taken for i in batch[6:]] == expected_ids(1, epoch)
    # On 2 ranks, each rank's batches hold the shares too, and a state resumes exactly.
    shares = []
    for rank in range(2):
        whole = make(server, dataset=STRATIFIED, batch_size=8, rank=rank, world_size=2)
        shares.append([ids.tolist() for _, _, ids in whole])
        assert len(shares[-1]) == 4
    together = sorted(i for share in shares for batch in share for i in batch)
    assert together == sorted(expected_ids(0, 0) + expected_ids(1, 0))
    for at in (1, 3):
        loader = make(server, dataset=STRATIFIED, batch_size=8, rank=1, world_size=2)
        head = []
        for n, (_, _, ids) in enumerate(loader, start=1):
            head.append(ids.tolist())
            if n == at:
                break
        resumed = make(server, dataset=STRATIFIED, batch_size=8, rank=1, world_size=2)
        resumed.load_state_dict(loader.state_dict())
        assert head + [ids.tolist() for _, _, ids in resumed] == shares[1]


def test_a_stratified_epoch_ends_as_its_first_source_runs_out(server: BatchwireServer) -> None:
    # 0.7/0.3 of an epoch of 64: 45 of big and 19 of small (upsampled); batches of 4 hold
    # 3 of big and 1 of small (2.8 and 1.2, rounded), so big runs out after 15 batches and
    # small's last 4 of the epoch are dropped.
    mixture = Mixture({"big": 0.7, "small": 0.3}, batching="stratified")
    loader = make(server, dataset=mixture, batch_size=4)
    assert loader.source_counts == {"big": 45, "small": 19} and len(loader) == 15
    first = [ids.tolist() for _, _, ids in loader]
    assert len(first) == 15
    state = loader.state_dict()
    assert state["epoch"] == 1  # the end of an epoch is the start of the next
    resumed = make(server, dataset=mixture, batch_size=4)
    resumed.load_state_dict(state)
    second = [ids.tolist() for _, _, ids in resumed]
    big = mixture_order(source_seed(SEED, 0), 1, (48,), (45,)).tolist()
    small = (mixture_order(source_seed(SEED, 1), 1, (16,), (19,)) + 48).tolist()
    assert [i for batch in second for i in batch[:3]] == big
    assert [batch[3] for batch in second] == small[:15]
    with pytest.raises(InvalidArgumentError, match="drop_last=True"):
        make(server, dataset=mixture, drop_last=False)
    with pytest.raises(InvalidArgumentError, match="at least 10"):
        make(server, dataset=Mixture({"big": 0.9, "small": 0.1}, batching="stratified"))
    with pytest.raises(InvalidArgumentError, match="given no samples"):
        Mixture({"big": 1, "small": 0}, batching="stratified")


def test_a_stratified_batch_of_views_joins_each_sources_share_view_by_view(
    server: BatchwireServer,
) -> None:
    """multicrop over a stratified mixture: each of the ten views holds each source's
    share of the batch (6 of big, 2 of small), in the order of the ids."""
    views_params = {"global_size": 24, "local_size": 16}
    loader = make(
        server, dataset=STRATIFIED, batch_size=8, pipeline="multicrop", params=views_params
    )
    taken = []
    for views, labels, ids in loader:
        assert len(views) == 10 and len(labels) == 8
        assert [tuple(v.shape) for v in views] == [(8, 3, 24, 24)] * 2 + [(8, 3, 16, 16)] * 8
        assert loader.split_ids(ids)[0].tolist() == [0] * 6 + [1] * 2
        taken.append(ids.tolist())
    assert [i for batch in taken for i in batch[:6]] == expected_ids(0, 0)
    assert [i for batch in taken for i in batch[6:]] == expected_ids(1, 0)
