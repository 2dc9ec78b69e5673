"""What a training job meets around the stream: DDP rank detection, a server going away,
health before the server is ready."""

from __future__ import annotations

import collections
import json
import logging
import pathlib

import grpc
import pytest
import torch.multiprocessing as mp
from conftest import start_server
from ddp_worker import stream_rank
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchwire.client import RemoteLoader, UnavailableError
from batchwire.common.sampler import Plan
from batchwire.server import BatchwireServer, ServerConfig


def test_ranks_come_from_torch_distributed_when_a_pass_starts(
    server: BatchwireServer, tmp_path: pathlib.Path
) -> None:
    init_file = str(tmp_path / "ddp-init")
    mp.start_processes(
        stream_rank,
        args=(2, init_file, server.target, str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        plan = Plan(num_samples=520, batch_size=20, seed=11, rank=rank, world_size=2)
        assert result["share"] == [rank, 2]
        assert result["ids"] == plan.share().tolist()
        # rank=0, world_size=1 given while torch.distributed says otherwise: refused.
        assert "torch.distributed is initialized with rank" in result["explicit"]
    assert not set(results[0]["ids"]) & set(results[1]["ids"])
    assert len(results[0]["ids"]) == len(results[1]["ids"]) == 260
    assert results[0]["solo"] == Plan(num_samples=520, batch_size=20, seed=11).share().tolist()


def test_a_server_that_goes_away_mid_epoch_raises_in_the_loop(
    data_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The loader's only server stops: the log says it is retried and for how long, and the
    error after retry_timeout names the setting with its value."""
    server = start_server(data_dir)
    loader = RemoteLoader(
        server.target,
        dataset="shapes",
        pipeline="val",
        batch_size=8,
        prefetch=1,
        params={"size": 32},
        timeout=30,
        retry_timeout=2,
    )
    iterator = iter(loader)
    next(iterator)
    server.stop(grace=0)
    with (
        caplog.at_level(logging.WARNING, logger="batchwire.client"),
        pytest.raises(UnavailableError, match=r"retry_timeout=2\)") as caught,
    ):
        for _ in iterator:
            pass
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no server delivered a batch for 2s while they were retried" in str(caught.value)
    said = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert said, caplog.text
    assert all("other servers" not in line for line in said), said
    assert any("only server" in line and "retry_timeout=2s" in line for line in said), said
    loader.close()


def test_health_stays_not_serving_without_datasets(tmp_path: pathlib.Path) -> None:
    server = BatchwireServer(
        ServerConfig(data_dir=tmp_path, host="localhost", port=0, device="cpu")
    )
    server.start()
    try:
        assert not server.wait_serving(2.0)
        with grpc.insecure_channel(server.target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(grace=0)


def test_a_server_open_to_every_interface_in_plaintext_says_so(
    data_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server on every interface with no TLS and no token warns and names --host; one
    on localhost (the default) does not. Either names the port it got for --port 0."""
    said = {}
    for host in ("[::]", "localhost"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="batchwire.server"):
            server = start_server(data_dir, host=host)
            server.stop(grace=0)
        messages = [r.getMessage() for r in caplog.records]
        said[host] = [m for m in messages if "every interface" in m]
        listening = [m for m in messages if m.startswith("listening on")]
        assert listening[0].startswith(f"listening on {host}:{server.port} ("), messages
    (warning,) = said["[::]"]
    assert "--host localhost" in warning and "--token-file" in warning
    assert said["localhost"] == []


def test_a_validation_loop_sees_every_sample_as_torchs_would(
    server: BatchwireServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An evaluation pass over 520 samples in batches of 24, with the loader's defaults:
    every sample once, the last batch short (torch's DataLoader keeps it too), and nothing
    said. On 3 ranks each takes 174 samples (the last 2 padded from the epoch's start, as
    DistributedSampler pads) in as many steps, and each loader says so once."""
    options = {"dataset": "shapes", "pipeline": "val", "params": {"size": 32}, "shuffle": False}
    with caplog.at_level(logging.INFO, logger="batchwire.client"):
        loader = RemoteLoader(server.target, batch_size=24, return_ids=True, **options)  # type: ignore[arg-type]
        batches = [ids.tolist() for _, _, ids in loader]
        assert len(loader) == len(batches) == 22
        loader.close()
    assert [len(ids) for ids in batches][-2:] == [24, 16]
    assert sorted(i for ids in batches for i in ids) == list(range(520))
    assert not [r for r in caplog.records if "drop_last" in r.getMessage()], caplog.text

    caplog.clear()
    ranks = [
        RemoteLoader(server.target, batch_size=24, return_ids=True, rank=r, world_size=3, **options)  # type: ignore[arg-type]
        for r in range(3)
    ]
    with caplog.at_level(logging.INFO, logger="batchwire.client"):
        shares = [[i for _, _, ids in rank for i in ids.tolist()] for rank in ranks]
        steps = {len(rank) for rank in ranks}
        for rank in ranks:
            rank.close()
    assert steps == {8} and [len(share) for share in shares] == [174] * 3
    counts = collections.Counter(i for share in shares for i in share)
    assert set(counts) == set(range(520)) and sorted(counts.values())[-2:] == [2, 2]
    said = [r for r in caplog.records if "repeats" in r.getMessage()]
    assert len(said) == 3 and {r.levelno for r in said} == {logging.WARNING}, caplog.text
    assert "repeats 2 samples of the 520 samples" in said[0].getMessage()
    assert "padding 3 ranks to the same number of steps" in said[0].getMessage()


def test_a_loop_that_drop_last_leaves_samples_out_of_is_told_once(
    server: BatchwireServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An evaluation pass (no shuffle) over 520 samples in batches of 24 with
    drop_last=True: 16 are left out of every epoch, and the loader warns once, naming
    drop_last=False; with shuffle (training), the same line at INFO."""
    options = {"dataset": "shapes", "pipeline": "val", "params": {"size": 32}, "drop_last": True}
    with caplog.at_level(logging.INFO, logger="batchwire.client"):
        loader = RemoteLoader(server.target, batch_size=24, shuffle=False, **options)  # type: ignore[arg-type]
        assert sum(len(labels) for _, labels in loader) == 504
        assert sum(len(labels) for _, labels in loader) == 504
        loader.close()
    said = [r for r in caplog.records if "leaves out" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text
    assert "leaves out 16 samples of the 520 samples" in said[0].getMessage()
    assert "drop_last=False" in said[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="batchwire.client"):
        training = RemoteLoader(server.target, batch_size=24, **options)  # type: ignore[arg-type]
        assert sum(len(labels) for _, labels in training) == 504
        training.close()
    said = [r for r in caplog.records if "leaves out" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, caplog.text
