"""`batchwire bench` and `python -m benchmarks` run end to end (small sizes; the numbers
themselves are not tested)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import re

import pytest
from conftest import start_server

import benchmarks
from batchwire.cli import build_parser, main
from batchwire.server.data import ingest, write_image_folders
from batchwire.server.engine import visible_gpu_count
from benchmarks._server_probe import gpu_memory_mib

_FIGURES = ("images_per_s", "trainer_cpu_per_1000")
_CHECKOUT = pathlib.Path(__file__).resolve().parents[1]
_RESEARCH = (
    "--messages",
    "--scaling",
    "--stages",
    "--streams",
    "--fleet",
    "--chaos",
    "--cold",
    "--profile",
    "--autoscale",
)


@pytest.mark.slow
def test_compare_runs_every_measurement_and_writes_json_and_a_chart(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    result, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    args = [
        "bench",
        "--compare",
        "--photos",
        "48",
        "--images",
        "32",
        "--batch-size",
        "16",
        "--repeats",
        "1",
        "--workers",
        "1",
        "--json",
        str(result),
        "--plot",
        str(chart),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    for label in (
        "(a) DALI's own pipeline in-process",
        "(b) remote",
        "(c) torch DataLoader + PIL",
        "(d) transport only",
        "(e) raw gRPC ceiling",
        "b/a images/s",
        "d/e images/s",
        "no-decode remote/DALI images/s",
        "no-decode server/DALI CPU",
        "no-decode: as to another host",
        "no-decode socket/DALI images/s",
        "no-decode socket server/DALI CPU",
        "small remote/DALI images/s",
        "no-decode: a mixture -> RemoteLoader",
        "mixture/one dataset images/s",
        "no-decode: stratified batches -> RL",
        "stratified/one dataset images/s",
        "no-decode: per-source batches -> RL",
        "per-source/one dataset images/s",
        "multicrop: DALI's own in-process",
        "multicrop remote/DALI images/s",
        "detection: DALI's own (COCO reader)",
        "detection server/DALI CPU",
        "segmentation: DALI's own (2 readers)",
        "segmentation remote/DALI images/s",
        "captions: DALI's own (WebDataset)",
        "captions server/DALI CPU",
        "bytes per image",
    ):
        assert label in out
    summary = json.loads(result.read_text())["summary"]
    assert set(summary) == {
        "dali",
        "remote",
        "pil",
        "transport",
        "raw",
        "engine",
        "dali-nodecode",
        "remote-nodecode",
        "remote-socket",
        "dali-small",
        "remote-small",
        "remote-one",
        "remote-mixture",
        "remote-stratified",
        "remote-per-source",
        "dali-multicrop",
        "remote-multicrop",
        "dali-detection",
        "remote-detection",
        "dali-segmentation",
        "remote-segmentation",
        "dali-captions",
        "remote-captions",
    }
    for name, row in summary.items():
        # CPU figures are measured, not tested: tiny runs fall within a clock tick.
        assert row["images"] >= 32, name
        assert all(math.isfinite(row[k]) and row[k] >= 0 for k in _FIGURES), name
    assert "server_cpu_per_1000" in summary["remote"]
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_against_a_running_server_reports_rate_and_client_cpu(
    server,
    capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    args = [
        "bench",
        "--address",
        server.target,
        "--dataset",
        "shapes",
        "--pipeline",
        "val",
        "--images",
        "2080",
        "--batch-size",
        "130",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "images/s" in out and "time to first batch" in out and "per 1000 images" in out
    # 520 samples: 4 passes of 4 batches, 3 waits from one pass to the next.
    assert re.search(r"between passes: [\d.]+s .* \(median of 3\), against [\d.]+s", out), out


@pytest.mark.timeout(120)  # it used to open empty streams forever
def test_against_a_dataset_smaller_than_a_batch_stops_and_says_why(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_image_folders(tmp_path / "images", per_class=2, size=32, seed=3)  # 8 samples
    ingest(tmp_path / "images", tmp_path / "datasets", name="tiny")
    server = start_server(tmp_path / "datasets")
    try:
        args = ["bench", "--address", server.target, "--dataset", "tiny", "--pipeline", "val"]
        assert main([*args, "--batch-size", "16", "--images", "32"]) == 2
    finally:
        server.stop(grace=1.0)
    err = capsys.readouterr().err
    # The loader itself refuses a batch larger than its share, before any stream opens.
    assert "batch_size 16 is larger than this rank's share" in err
    assert "(8 samples over 1 rank)" in err and "Lower batch_size" in err


@pytest.mark.slow
def test_compare_can_run_a_subset_to_profile_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    result = tmp_path / "bench.json"
    common = ["bench", "--compare", "--photos", "48", "--images", "64", "--batch-size", "16"]
    assert main([*common, "--repeats", "1", "--runs", "transport,raw", "--json", str(result)]) == 0
    assert set(json.loads(result.read_text())["summary"]) == {"transport", "raw"}
    assert "d/e images/s" in capsys.readouterr().out
    assert main([*common, "--runs", "transport,nope"]) == 2
    assert "--runs takes names from" in capsys.readouterr().err


def test_compare_captions_runs_dalis_webdataset_reader_beside_the_server(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The captions row: DALI's WebDataset reader over the generated shards and the
    captions preset's graph in this process, beside a server of the same shards ingested,
    each run counting its samples as a batch of images and captions holds them."""
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    result = tmp_path / "bench.json"
    args = ["bench", "--compare", "--runs", "captions", "--photos", "40", "--images", "32"]
    assert main([*args, "--batch-size", "16", "--repeats", "1", "--json", str(result)]) == 0
    out = capsys.readouterr().out
    for label in (
        "captions: DALI's own (WebDataset)",
        "captions: server -> RemoteLoader",
        "captions remote/DALI images/s",
        "captions server/DALI CPU",
    ):
        assert label in out, out
    summary = json.loads(result.read_text())["summary"]
    assert set(summary) == {"dali-captions", "remote-captions"}
    # Two batches of 16 each: a sample a caption, however long its caption.
    assert summary["dali-captions"]["images"] == summary["remote-captions"]["images"] == 32
    # A batch as the loop takes it: 224 x 224 x 3 pixels and a caption of 26 to 158 bytes.
    per_image = summary["remote-captions"]["bytes_per_image"]
    assert 3 * 224 * 224 + 26 <= per_image <= 3 * 224 * 224 + 158, per_image
    assert f"captions: server -> RemoteLoader: {per_image:,.0f} bytes per image" in out


def test_the_captions_data_is_webdataset_shards_that_dali_indexes_and_ingest_serves(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The captions row's data, made once: photos with captions as WebDataset shards
    (``key.jpg`` beside ``key.txt``) each with its DALI index, and the same shards ingested:
    the server gives every caption of the shards, once."""
    import tarfile

    from batchwire.bench import bench_captions
    from batchwire.client import RemoteLoader

    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    shards, data_dir, name = bench_captions(20, progress=False)
    assert "generating 20 photos with captions" in capsys.readouterr().err
    assert bench_captions(20, progress=False) == (shards, data_dir, name)
    assert "generating" not in capsys.readouterr().err
    tars = sorted(shards.glob("*.tar"))
    assert len(tars) == 8 and all(t.with_suffix(".idx").is_file() for t in tars)
    captions: dict[str, str] = {}
    for shard in tars:
        with tarfile.open(shard) as archive:
            names = archive.getnames()
            keys = {n.rsplit(".", 1)[0] for n in names}
            assert sorted(names) == sorted(f"{k}.{e}" for k in keys for e in ("jpg", "txt"))
            for key in keys:
                member = archive.extractfile(f"{key}.txt")
                assert member is not None
                captions[key] = member.read().decode()
            # DALI's index: its samples, each a jpg and a txt.
            index = shard.with_suffix(".idx").read_text().splitlines()
            assert index[0] == f"v1.2 {len(keys)}" and len(index) == len(keys) + 1
    assert len(captions) == 20
    # A sentence or two each, of varying length.
    assert all(t.endswith(".") and 1 <= t.count(".") <= 2 for t in captions.values())
    assert len({len(t) for t in captions.values()}) > 3
    server = start_server(data_dir)
    try:
        with RemoteLoader(
            server.target,
            dataset=name,
            pipeline="captions",
            batch_size=5,
            shuffle=False,
            normalize=False,
        ) as loader:
            served = [text for _, texts in loader for text in texts]
    finally:
        server.stop(grace=1.0)
    assert sorted(served) == sorted(captions.values())


@pytest.mark.slow
def test_stages_times_each_stage_of_dali_and_pil(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    assert benchmarks.main(["--stages", "--photos", "48"]) == 0
    rows = {
        line[:48].strip(): float(line[48:])
        for line in capsys.readouterr().out.splitlines()[1:]
        if line.strip()
    }
    assert len(rows) == 8
    # Per-stage rows are differences of timed runs (noise can make one negative).
    assert all(math.isfinite(v) for v in rows.values())
    for stage in ("decode, whole image", "all of"):
        assert any(name.startswith(f"DALI {stage}") for name in rows)
        assert any(name.startswith(f"PIL {stage}") for name in rows)


def _small(data_dir: pathlib.Path, result: pathlib.Path, *mode: str) -> list[str]:
    """``python -m benchmarks`` arguments for ``mode`` on the test dataset, small and fast,
    writing JSON to ``result``."""
    small = ["--dataset", "shapes", "--batch-size", "8", "--size", "32"]
    return [*mode, "--data-dir", str(data_dir), *small, "--json", str(result)]


@pytest.mark.slow
def test_streams_opens_k_concurrent_streams_on_one_server_and_reports_each_k(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "streams.json"
    # val: the server LocalServer starts serves every preset, not only train.
    mode = ["--streams", "1,3", "--duration", "6", "--pipeline", "val", "--device", "cpu"]
    assert benchmarks.main(_small(data_dir, result, *mode)) == 0
    out = capsys.readouterr().out
    assert "K=3 vs K=1: images/s" in out and "GPU MiB/stream" in out
    measured = json.loads(result.read_text())
    assert measured["run"]["pipeline"] == "val" and measured["run"]["device"] == "cpu"
    rows = measured["streams"]
    assert [row["streams"] for row in rows] == [1, 3]
    for row in rows:
        assert row["refused"] == 0 and row["starved"] == 0, row
        assert row["images_per_s"] > 0 and row["threads"] > 1 and row["rss_mib"] > 0, row
        assert 0 <= row["first_p50"] <= row["first_max"] < 6, row
        # The server's own figures over the second half, per image it sent.
        assert row["device"] == "cpu" and row["cpu_ms_per_image"] > 0, row
        for stage in ("read", "pipeline", "encode"):
            assert row[f"{stage}_ms_per_image"] > 0, (stage, row)
        assert row["send_ms_per_image"] >= 0, row
        if measured["machine"]["gpus"] == 0:
            assert row["gpu_mib"] is None and row["gpu_mib_per_stream"] is None, row
    assert benchmarks.main(["--streams", "0"]) == 2
    assert "--streams takes stream counts" in capsys.readouterr().err


@pytest.mark.skipif(visible_gpu_count() > 0, reason="a GPU is visible: --device gpu starts")
def test_a_server_that_cannot_start_ends_the_benchmark_with_its_reason(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mode = ["--streams", "1", "--duration", "2", "--device", "gpu"]
    assert benchmarks.main(_small(data_dir, tmp_path / "streams.json", *mode)) == 2
    err = capsys.readouterr().err
    assert "error: batchwire serve exited with status 2 before it listened" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_chaos_stops_servers_under_two_ranks_and_counts_nothing_lost_or_repeated(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "chaos.json"
    # Two stops however long a stop and a restart (drain, exit, start, warm-up) take here.
    mode = ["--chaos", "--duration", "4", "--every", "2", "--stops", "2"]
    assert benchmarks.main(_small(data_dir, result, *mode)) == 0
    assert "exactly once: yes" in capsys.readouterr().out
    chaos = json.loads(result.read_text())["chaos"]
    assert sum(chaos["kills"].values()) >= 2  # servers were stopped while ranks streamed
    for rank in chaos["ranks"]:
        assert rank["epochs"] >= 1 and rank["lost"] == 0 and rank["repeated"] == 0, rank
        assert rank["samples"] == rank["epochs"] * 260  # 520 samples, two ranks


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="--fleet pins a server to each of 2 cores")
def test_fleet_measures_each_server_alone_and_one_loader_over_both(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    result = tmp_path / "fleet.json"
    args = ["--fleet", "--photos", "48", "--images", "48", "--batch-size", "16"]
    assert benchmarks.main([*args, "--repeats", "1", "--json", str(result)]) == 0
    out = capsys.readouterr().out
    assert "both/(fast+slow) images/s" in out
    rows = json.loads(result.read_text())["fleet"]
    assert set(rows) == {"fast", "slow", "both"}
    assert all(row["images_per_s"] > 0 for row in rows.values()), rows


@pytest.mark.slow
def test_long_run_reports_memory_at_start_and_end(
    data_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--duration", "4", "--data-dir", str(data_dir), "--dataset", "shapes"]
    assert benchmarks.main([*args, "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "images in 4s" in out and "server RSS MiB" in out and "client RSS MiB" in out


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="--scaling pins a server to each of 2 cores")
def test_scaling_measures_one_server_then_two(
    data_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--scaling", "--data-dir", str(data_dir), "--dataset", "shapes"]
    assert benchmarks.main([*args, "--images", "32", "--batch-size", "8"]) == 0
    assert "x with 2 servers (ideal 2.00x)" in capsys.readouterr().out


@pytest.mark.slow
def test_cold_reads_the_dataset_cold_and_warm_and_its_read_stage_alone(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "cold.json"
    mode = ["--cold", "--cold-streams", "2", "--duration", "4", "--pipeline", "val"]
    mode += ["--device", "cpu", "--repeats", "1", "--images", "64"]
    assert benchmarks.main(_small(data_dir, result, *mode)) == 0
    out = capsys.readouterr().out
    assert "cold/warm" in out and "read stage, cold: read-ahead" in out
    measured = json.loads(result.read_text())
    assert measured["run"]["disk"] and measured["run"]["bytes"] > 0
    (row,) = measured["cold"]
    assert row["streams"] == 2
    for figure in ("cold_images_per_s", "warm_images_per_s", "cold_one_at_a_time_images_per_s"):
        assert row[figure] > 0, (figure, row)
    assert row["rss_cold_mib"] > 0 and row["rss_warm_mib"] > 0
    assert row["cpu_ms_per_image_cold"] > 0 and row["cpu_ms_per_image_warm"] > 0
    assert row["read_ahead_records_per_s"] > 0 and row["one_at_a_time_records_per_s"] > 0
    (ratio,) = row["cold_over_warm_each_repeat"]
    assert ratio == pytest.approx(row["cold_images_per_s"] / row["warm_images_per_s"])


@pytest.mark.slow
def test_cold_mixture_reads_a_mixture_and_one_dataset_cold_and_warm(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "cold-mixture.json"
    mode = ["--cold", "--cold-mixture", "--cold-streams", "2", "--duration", "4"]
    mode += ["--pipeline", "val", "--device", "cpu", "--repeats", "1", "--images", "64"]
    assert benchmarks.main(_small(data_dir, result, *mode)) == 0
    assert "mixture/one" in capsys.readouterr().out
    rows = json.loads(result.read_text())["cold_mixture"]
    assert [(row["streams"], row["state"]) for row in rows] == [(2, "cold"), (2, "warm")]
    for row in rows:
        assert row["one"] > 0 and row["mixture"] > 0, row


@pytest.mark.slow
def test_profile_says_where_a_servers_time_and_lock_go(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    args = ["--profile", "--pipeline", "nodecode", "--photos", "48", "--images", "64"]
    assert benchmarks.main([*args, "--batch-size", "16", "--duration", "2"]) == 0
    out = capsys.readouterr().out
    assert "every running thread" in out and "lock held" in out, out
    # The functions on the batch path are named, with their share of the samples.
    assert "Runner.run (batchwire/server/runners/_runner.py" in out, out
    # The server's context switches a batch, by thread name: DALI's executor among them.
    switches = re.search(r"server context switches a batch: ([0-9.]+) \((.*)\)", out)
    assert switches is not None, out
    assert float(switches[1]) > 0 and "[DALI] Executor" in switches[2], out


def test_benchmarks_need_a_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert benchmarks.main([]) == 2
    err = capsys.readouterr().err
    assert all(flag in err for flag in _RESEARCH) and "--duration alone" in err


def test_installed_bench_offers_only_address_and_compare(
    capsys: pytest.CaptureFixture[str],
) -> None:
    subparsers = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    options = set(subparsers.choices["bench"]._option_string_actions)
    assert {"--address", "--compare", "--duration", "--runs", "--json", "--plot"} <= options
    assert not options & {*_RESEARCH, "--size", "--every"}
    with pytest.raises(SystemExit) as refused:
        main(["bench", "--streams", "1,64"])
    assert refused.value.code == 2
    capsys.readouterr()
    for args in (["bench"], ["bench", "--duration", "60"]):  # no mode; a long run is research
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "--address" in err and "--compare" in err, err
        assert "research modes" in err and "`python -m benchmarks`" in err, err
        assert "from a checkout" in err, err


@pytest.mark.skipif(
    importlib.util.find_spec("pynvml") is not None, reason="NVML answers before nvidia-smi"
)
def test_streams_reads_gpu_memory_from_nvidia_smi_where_there_is_no_nvml(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An nvidia-smi of this test's own: a GPU with two processes, 79,000 MiB used in all.
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --query-compute-apps=*) printf "41, 1500\\n42, 2048\\n" ;;\n'
        '  --query-gpu=*) printf "79000\\n" ;;\n'
        "  *) exit 6 ;;\n"
        "esac\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_memory_mib(42) == 2048
    # A pid the driver does not list (another PID namespace): the GPU's memory in use.
    assert gpu_memory_mib(7) == 79000
    smi.unlink()
    assert gpu_memory_mib(42) is None  # no GPU here


@pytest.mark.slow
def test_host_trainers_measures_a_server_and_its_trainer_processes_against_dali(
    data_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--host-trainers", "1", "--data-dir", str(data_dir), "--dataset", "shapes"]
    args += ["--pipeline", "val", "--batch-size", "8", "--images", "64", "--duration", "2"]
    assert benchmarks.main(args) == 0
    rows = {
        line[:52].strip(): line[52:].split()
        for line in capsys.readouterr().out.splitlines()[1:]
        if line.strip()
    }
    assert set(rows) == {
        "DALI's own in-process",
        "serve (defaults) -> 1 trainer",
        "serve --no-shared-memory -> 1 trainer",
        "serve --no-shared-memory --no-bulk -> 1 trainer",
        "serve --workers 1 -> 1 trainer",
        "serve --workers 2 -> 1 trainer",
    }
    assert all(float(values[0]) > 0 for values in rows.values()), rows
    # Each worker's share of the batches: one trainer process is served by both workers.
    assert rows["serve --workers 1 -> 1 trainer"][-1] == "1.00"
    shares = [float(share) for share in rows["serve --workers 2 -> 1 trainer"][-1].split("/")]
    assert len(shares) == 2 and min(shares) > 0 and sum(shares) == pytest.approx(1, abs=0.02)


def test_host_trainers_refuses_a_server_setting_it_does_not_know(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert benchmarks.main(["--host-trainers", "1", "--host-servers", "workers2,workers9"]) == 2
    error = capsys.readouterr().err
    assert (
        "unknown workers9" in error
        and "defaults,no-shared-memory,no-bulk,workers1,workers2" in error
    )


def test_the_plain_tcp_ceiling_receives_every_message_whole() -> None:
    """`--messages`'s row under gRPC's: the same bytes over plain TCP, every message
    received whole (a short one would raise), the server's CPU measured."""
    from batchwire.bench import plain_server, run_plain

    with plain_server(3 * 65536 + 5) as (address, pid):
        result = run_plain(address, pid, 3 * 65536 + 5, 40)
        again = run_plain(
            address, pid, 3 * 65536 + 5, 3
        )  # the server takes connection after connection
    assert (result.images, again.images) == (40, 3)
    assert result.seconds > 0 and result.server_cpu is not None


def test_the_generated_dataset_says_it_is_being_made_once_even_without_a_terminal(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Generating the benchmark's photos takes minutes at their default count: a run whose
    stderr is a log file (no progress bar) still says what it is doing, and only the first
    time."""
    from batchwire.bench import bench_dataset

    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "cache"))
    first = bench_dataset(None, None, 6, (16, 16))
    said = capsys.readouterr().err
    assert "generating 6 photos of 16x16" in said and "once" in said, said
    assert bench_dataset(None, None, 6, (16, 16)) == first
    assert "generating" not in capsys.readouterr().err
    assert (first[0] / first[1] / "manifest.json").is_file()


def test_the_waiting_pipeline_streams_small_images_of_every_sample(
    data_dir: pathlib.Path,
) -> None:
    """`--pipeline wait`'s stand-in for a GPU: each batch a wait, each sample a 16 x 16 x 3
    uint8 image of zeros, every sample of the share delivered once with its label."""
    import tomllib

    import torch

    from batchwire.bench import NO_DECODE_TOML
    from batchwire.client import RemoteLoader
    from batchwire.server import pipelines_from_config

    pipelines = pipelines_from_config(tomllib.loads(NO_DECODE_TOML)["pipelines"])
    server = start_server(data_dir, pipelines=pipelines)
    try:
        with RemoteLoader(
            server.target,
            dataset="shapes",
            pipeline="wait",
            batch_size=32,
            shuffle=False,
            normalize=False,
            return_ids=True,
            params={"wait_ms": 1},
        ) as loader:
            batches = list(loader)
    finally:
        server.stop(grace=1.0)
    ids = torch.cat([batch[2] for batch in batches])
    assert sorted(ids.tolist()) == list(range(len(ids))) and len(ids) == 520
    assert all(batch[0].shape[1:] == (3, 16, 16) for batch in batches)
    assert all(batch[0].dtype == torch.uint8 and not batch[0].any() for batch in batches)
