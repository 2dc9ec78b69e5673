"""How ``batchwire bench --compare`` reports: a table, the target ratios, JSON, a chart."""

from __future__ import annotations

import json
import pathlib
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from batchwire.bench._runs import RunResult

__all__ = ["TARGETS", "draw_chart", "ratios", "summarize", "table", "write_json"]

LABELS = {
    "dali": "(a) DALI's own pipeline in-process",
    "remote": "(b) remote: server -> RemoteLoader",
    "pil": "(c) torch DataLoader + PIL",
    "transport": "(d) transport only (no decode)",
    "raw": "(e) raw gRPC ceiling",
    "engine": "batchwire's engine in-process",
    "dali-nodecode": "no-decode: DALI's own in-process",
    "remote-nodecode": "no-decode: server -> RemoteLoader",
    "remote-socket": "no-decode: as to another host",
    "dali-small": "small images: DALI's own in-process",
    "remote-small": "small images: server -> RemoteLoader",
    "remote-one": "no-decode: one dataset -> RemoteLoader",
    "remote-mixture": "no-decode: a mixture -> RemoteLoader",
    "remote-stratified": "no-decode: stratified batches -> RL",
    "remote-per-source": "no-decode: per-source batches -> RL",
    "dali-multicrop": "multicrop: DALI's own in-process",
    "remote-multicrop": "multicrop: server -> RemoteLoader",
    "dali-detection": "detection: DALI's own (COCO reader)",
    "remote-detection": "detection: server -> RemoteLoader",
    "dali-segmentation": "segmentation: DALI's own (2 readers)",
    "remote-segmentation": "segmentation: server -> RemoteLoader",
    "dali-captions": "captions: DALI's own (WebDataset)",
    "remote-captions": "captions: server -> RemoteLoader",
}


def _against_dali(
    preset: str,
) -> tuple[tuple[str, Callable[[dict[str, Any]], float], float, bool], ...]:
    """A preset's two targets against DALI's own pipeline of the same graph in process: at
    least 0.9 of its images/s, at most 1.2 times its CPU per image (the server's)."""
    remote, dali = f"remote-{preset}", f"dali-{preset}"
    return (
        (f"{preset} remote/DALI images/s", lambda m: _rate(m, remote) / _rate(m, dali), 0.9, True),
        (
            f"{preset} server/DALI CPU",
            lambda m: m[remote]["server_cpu_per_1000"] / m[dali]["trainer_cpu_per_1000"],
            1.2,
            False,
        ),
    )


def _rate(m: dict[str, Any], name: str) -> float:
    return float(m[name]["images_per_s"])


def _against_dali_nodecode(
    label: str, run: str, *, cpu_target: float
) -> tuple[tuple[str, Callable[[dict[str, Any]], float], float, bool], ...]:
    """A no-decode run's two targets against DALI's own no-decode pipeline: at least 0.6
    of its images/s, at most ``cpu_target`` times its CPU per image (the server's)."""
    return (
        (
            f"no-decode {label}/DALI images/s",
            lambda m: _rate(m, run) / _rate(m, "dali-nodecode"),
            0.6,
            True,
        ),
        (
            f"no-decode {'server' if label == 'remote' else label + ' server'}/DALI CPU",
            lambda m: m[run]["server_cpu_per_1000"] / m["dali-nodecode"]["trainer_cpu_per_1000"],
            cpu_target,
            False,
        ),
    )


# name, how it is computed, target, True: at least the target (False: at most)
TARGETS: tuple[tuple[str, Callable[[dict[str, Any]], float], float, bool], ...] = (
    ("b/a images/s", lambda m: _rate(m, "remote") / _rate(m, "dali"), 0.95, True),
    (
        "c/b trainer CPU per image",
        lambda m: m["pil"]["trainer_cpu_per_1000"] / m["remote"]["trainer_cpu_per_1000"],
        20.0,
        True,
    ),
    ("d/e images/s", lambda m: _rate(m, "transport") / _rate(m, "raw"), 0.8, True),
    ("b/c images/s", lambda m: _rate(m, "remote") / _rate(m, "pil"), 1.0, True),
    *_against_dali_nodecode("remote", "remote-nodecode", cpu_target=1.2),
    *_against_dali_nodecode("socket", "remote-socket", cpu_target=1.3),
    (
        "small remote/DALI images/s",
        lambda m: _rate(m, "remote-small") / _rate(m, "dali-small"),
        0.6,
        True,
    ),
    *(
        (
            f"{kind}/one dataset images/s",
            lambda m, run=run: _rate(m, run) / _rate(m, "remote-one"),
            0.95,
            True,
        )
        for kind, run in (
            ("mixture", "remote-mixture"),
            ("stratified", "remote-stratified"),
            ("per-source", "remote-per-source"),
        )
    ),
    *_against_dali("multicrop"),
    *_against_dali("detection"),
    *_against_dali("segmentation"),
    *_against_dali("captions"),
)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(results: Sequence[RunResult]) -> dict[str, dict[str, Any]]:
    """Medians per run name over the repetitions."""
    by_name: dict[str, list[RunResult]] = {}
    for result in results:
        by_name.setdefault(result.name, []).append(result)
    summary: dict[str, dict[str, Any]] = {}
    for name, runs in by_name.items():
        summary[name] = {
            "runs": len(runs),
            "images": runs[0].images,
            "images_per_s": _median([r.images_per_second for r in runs]),
            "images_per_s_all": [round(r.images_per_second, 1) for r in runs],
            "trainer_cpu_per_1000": _median([r.per_1000(r.trainer_cpu) for r in runs]),
            "server_cpu_per_1000": _median([r.per_1000(r.server_cpu) for r in runs]),
            "trainer_peak_rss_mib": max(r.trainer_rss_mib for r in runs),
            "server_peak_rss_mib": _median([r.server_rss_mib for r in runs]),
            "first_batch_s": _median([r.first_batch_seconds for r in runs]),
            "bytes_per_image": _median([r.bytes_per_image for r in runs]),
        }
    return summary


def ratios(summary: dict[str, dict[str, Any]]) -> list[tuple[str, float | None, str, bool]]:
    """(name, value or None when a run is missing, the target as text, whether the value
    meets it) for each target ratio."""
    out = []
    for name, compute, target, at_least in TARGETS:
        try:
            value = float(compute(summary))
        except (KeyError, TypeError, ZeroDivisionError):
            value = None
        meets = value is not None and (value >= target if at_least else value <= target)
        out.append((name, value, f"{'>=' if at_least else '<='} {target}", meets))
    return out


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``, or "-" as wide as the spec's width."""
    return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0] or 0))


def table(summary: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"{'run':<38} {'images/s':>9} {'trainer CPU-s':>14} {'server CPU-s':>13} "
        f"{'trainer RSS':>12} {'server RSS':>11}",
        f"{'':<38} {'(median)':>9} {'/1000 img':>14} {'/1000 img':>13} {'peak MiB':>12} {'peak MiB':>11}",
    ]
    for name in LABELS:
        if name not in summary:
            continue
        row = summary[name]
        lines.append(
            f"{LABELS[name]:<38} {_fmt(row['images_per_s'], '9.0f')} "
            f"{_fmt(row['trainer_cpu_per_1000'], '14.2f')} {_fmt(row['server_cpu_per_1000'], '13.2f')} "
            f"{_fmt(row['trainer_peak_rss_mib'], '12.0f')} {_fmt(row['server_peak_rss_mib'], '11.0f')}"
        )
    lines.append("")
    for name in (
        "remote-multicrop",
        "remote-detection",
        "remote-segmentation",
        "remote-captions",
    ):
        if summary.get(name, {}).get("bytes_per_image"):
            per_image = summary[name]["bytes_per_image"]
            lines.append(f"{LABELS[name]}: {per_image:,.0f} bytes per image, as the loop takes it")
    for name, value, target, meets in ratios(summary):
        verdict = "-" if value is None else ("meets" if meets else "MISSES")
        lines.append(f"{name:<32} {_fmt(value, '8.2f')}   target {target:<7}  {verdict}")
    return "\n".join(lines)


def write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def draw_chart(path: pathlib.Path, summary: dict[str, dict[str, Any]], title: str) -> None:
    """A bar chart of images/s per run (Pillow; no plotting library needed)."""
    from PIL import Image, ImageDraw

    names = [n for n in LABELS if n in summary and summary[n]["images_per_s"]]
    width, bar_height, left = 900, 46, 300
    image = Image.new("RGB", (width, 100 + bar_height * len(names) + 16 * len(TARGETS)), "white")
    draw = ImageDraw.Draw(image)
    draw.text((20, 20), title, fill="black")
    top = max(summary[n]["images_per_s"] for n in names)
    for i, name in enumerate(names):
        y = 60 + i * bar_height
        value = summary[name]["images_per_s"]
        length = int((width - left - 90) * value / top)
        draw.text((20, y + 12), LABELS[name], fill="black")
        draw.rectangle((left, y + 6, left + length, y + bar_height - 10), fill=(70, 120, 200))
        draw.text((left + length + 8, y + 12), f"{value:,.0f} img/s", fill="black")
    y = 70 + bar_height * len(names)
    for name, value, target, meets in ratios(summary):
        text = f"{name}: {_fmt(value, '.2f')} (target {target})"
        draw.text((20, y), text, fill="black" if value is None or meets else (200, 30, 30))
        y += 16
    image.save(path)
