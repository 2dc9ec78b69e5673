"""`batchwire bench` runs end to end (small sizes; the numbers themselves are not tested)."""

from __future__ import annotations

import json
import pathlib

import pytest

from batchwire.cli import main


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
        "(a) DALI in-process",
        "(b) remote",
        "(c) torch DataLoader + PIL",
        "(d) transport only",
        "(e) raw gRPC ceiling",
        "b/a images/s",
        "d/e images/s",
    ):
        assert label in out
    summary = json.loads(result.read_text())["summary"]
    assert set(summary) == {"inprocess", "remote", "pil", "transport", "raw"}
    for name, row in summary.items():
        assert row["images"] >= 32 and row["images_per_s"] > 0, name
        assert row["trainer_cpu_per_1000"] > 0, name
    assert summary["remote"]["server_cpu_per_1000"] > 0
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
        "64",
        "--batch-size",
        "32",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "images/s" in out and "time to first batch" in out and "per 1000 images" in out
