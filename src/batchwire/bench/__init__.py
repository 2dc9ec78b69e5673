"""The measurements behind ``batchwire bench`` and the research benchmarks in ``benchmarks/``.

Both import this module, so a figure in the docs and the installed command are made by the
same code:

- runs: :func:`run_dali` (DALI's own pipeline in the trainer's process, as its users write
  it; with the stand-in pipeline :func:`no_decode`), :func:`run_inprocess` (batchwire's engine
  in the trainer's process), :func:`run_remote` (a
  :class:`RemoteLoader <batchwire.client.RemoteLoader>` on a server), :func:`run_pil` (a
  PIL/torchvision ``DataLoader``), :func:`run_raw` (gRPC alone) — each a :class:`RunResult`
  of images/s, CPU and memory;
- servers: :class:`LocalServer` (``batchwire serve`` in a child process, waited for until
  SERVING), :func:`transport_server` and :func:`raw_server` (the transport without DALI);
- data: :func:`bench_dataset` (generated ImageNet-sized JPEGs, built once in
  ``~/.cache/batchwire/bench``), :func:`bench_coco` and :func:`bench_masks` (generated COCO
  pictures, their boxes and masks), :func:`bench_captions` (the photos with captions, as
  WebDataset shards and ingested);
- probes: :class:`CpuClock`, :class:`RssSampler`, :func:`process_tree`, :func:`rss_mib`,
  :func:`process_cpu_seconds`;
- reports: :func:`summarize`, :func:`ratios`, :func:`table`, :func:`write_json`,
  :func:`draw_chart`, and :func:`machine` (what the figures ran on).
"""

from __future__ import annotations

from batchwire.bench._captions import bench_captions, write_caption_shards
from batchwire.bench._dali import (
    NO_DECODE_TOML,
    SMALL_PHOTO,
    SMALL_SIZE,
    no_decode,
    pipeline_spec,
    run_dali,
)
from batchwire.bench._local_server import LocalServer, ServerStartError, wait_serving
from batchwire.bench._pil import LmdbPilDataset, pil_train_sample, run_pil
from batchwire.bench._probe import (
    CpuClock,
    RssSampler,
    process_cpu_seconds,
    process_tree,
    rss_mib,
)
from batchwire.bench._report import draw_chart, ratios, summarize, table, write_json
from batchwire.bench._runs import (
    IMAGE_BYTES,
    RunResult,
    add_run_arguments,
    bench_coco,
    bench_dataset,
    bench_masks,
    cache_dir,
    machine,
    progress,
    run_inprocess,
    run_remote,
)
from batchwire.bench._transport import (
    plain_server,
    raw_server,
    run_plain,
    run_raw,
    transport_server,
)

__all__ = [
    "IMAGE_BYTES",
    "NO_DECODE_TOML",
    "SMALL_PHOTO",
    "SMALL_SIZE",
    "CpuClock",
    "LmdbPilDataset",
    "LocalServer",
    "RssSampler",
    "RunResult",
    "ServerStartError",
    "add_run_arguments",
    "bench_captions",
    "bench_coco",
    "bench_dataset",
    "bench_masks",
    "cache_dir",
    "draw_chart",
    "machine",
    "no_decode",
    "pil_train_sample",
    "pipeline_spec",
    "plain_server",
    "process_cpu_seconds",
    "process_tree",
    "progress",
    "ratios",
    "raw_server",
    "rss_mib",
    "run_dali",
    "run_inprocess",
    "run_pil",
    "run_plain",
    "run_raw",
    "run_remote",
    "summarize",
    "table",
    "transport_server",
    "wait_serving",
    "write_caption_shards",
    "write_json",
]
