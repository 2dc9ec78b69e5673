"""Server configuration: a frozen object built from flags, the environment and a file.

Every setting is a field of :class:`ServerConfig`, declared once with its help, how it
is parsed from text and the values it takes; ``batchwire serve`` derives from that
declaration a flag ``--name``, an environment variable ``BATCHWIRE_NAME`` and a key
``name`` of a config file's ``[server]`` table (see :mod:`batchwire.server.config._file`).
Precedence: flags > environment > file > defaults.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from collections.abc import Mapping

from batchwire.server.config._setting import Setting, boolean, declared, device_ids, setting
from batchwire.server.errors import ConfigError
from batchwire.server.pipelines import PRESETS, PipelineSpec

__all__ = [
    "ConfigError",
    "ServerConfig",
    "Setting",
    "boolean",
    "device_ids",
    "settings",
]


DEFAULT_SLOTS_PER_DEVICE = 2


def _presets() -> dict[str, PipelineSpec]:
    return dict(PRESETS)


def _path(text: str) -> pathlib.Path:
    return pathlib.Path(text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything ``batchwire serve`` needs. ``port=0`` picks a free port.

    Each field but ``pipelines`` is a setting, declared here once: ``batchwire serve``
    derives its flag, its environment variable and its config-file key from it.
    """

    data_dir: pathlib.Path = setting(
        dataclasses.MISSING, "datasets live in DIR/NAME/", _path, metavar="DIR"
    )
    host: str = setting(
        "localhost",
        "address to listen on (default localhost: this machine only; 0.0.0.0 or [::]: every "
        "interface, for trainers on other hosts)",
        str,
    )
    port: int = setting(50051, "gRPC port (default 50051; 0: any free)", bounds=(0, 65535))
    device: str = setting(
        "auto", "where pipelines run (default auto)", str, choices=("auto", "cpu", "gpu")
    )
    devices: tuple[int, ...] = setting(
        (),
        "GPU ids to run pipelines on, e.g. 0,1; new streams are spread over them "
        "(default all: every visible GPU)",
        device_ids,
        metavar="IDS",
    )
    workers: int | None = setting(
        None,
        "server processes behind the port, each with its own interpreter (SO_REUSEPORT spreads "
        "connections over them); on a GPU host the GPUs are dealt out to them (default: on "
        "GPUs, up to 4 per GPU, one per 4 usable CPUs, at least one per GPU; 1 on the CPU)",
        bounds=(1, 256),
    )
    worker_port: int | None = setting(
        None,
        "with --workers N: worker i also listens on port PORT+i of its own, which the unit "
        "announces, so that each trainer process pulls from every worker (default: the ports "
        "after --port, or any free ones with --port 0; 0: any free)",
        metavar="PORT",
        bounds=(0, 65535),
    )
    num_threads: int = setting(
        0,
        "DALI threads per pipeline (default 0: on the CPU one per CPU this process may use, "
        "by its affinity and cgroup quota; on GPUs those CPUs shared by the GPUs, at most 8 "
        "each)",
        bounds=(0, 1024),
    )
    # DALI's own defaults, set here so that they are seen and sized: the mixed decoder keeps
    # two pinned host buffers and one device buffer of these sizes per DALI thread.
    decoder_host_padding_mib: int = setting(
        8,
        "GPU decoding: pinned host memory per decoder buffer, two per DALI thread, in MiB "
        "(default 8)",
        bounds=(0, 1024),
    )
    decoder_device_padding_mib: int = setting(
        16,
        "GPU decoding: device memory per decoder buffer, one per DALI thread, in MiB (default 16)",
        bounds=(0, 4096),
    )
    hw_decoder_load: float = setting(
        0.99,
        "GPU decoding: the share of JPEGs the GPU's hardware JPEG decoders take (A100, H100 "
        "and later; the rest are decoded by CUDA kernels, Huffman on the CPU); ignored on "
        "GPUs without them (default 0.99, MLPerf's setting on H100; DALI's own is 0.65)",
        float,
        bounds=(0.0, 1.0),
    )
    gpu_wait: str = setting(
        "auto",
        "GPU pipelines: how a worker's threads wait for the GPU: auto (CUDA's own: spin while "
        "the host has cores to spare), spin, yield, or block (sleep until the GPU is done: "
        "less CPU, a wake-up's latency more) (default auto)",
        str,
        choices=("auto", "spin", "yield", "block"),
    )
    prefetch: int = setting(2, "batches each pipeline computes ahead (default 2)", bounds=(1, 16))
    read_workers: int = setting(
        0,
        "deprecated and ignored (removed in the next release): every stream reads its "
        "records through the one record path, which reads a batch ahead of the pipelines",
        bounds=(0, 64),
        deprecated=True,
    )
    read_ahead_reads: int = setting(
        4,
        "threads that find the records of every stream's next batches and queue their reads "
        "with the kernel ahead of the pipelines, a batch at a time, one batch of a stream at "
        "once, for the streams whose reads wait for the disk for half their time between "
        "batches or more; each queues a batch's records together, so a few keep a disk busy "
        "(default 4; 0: off, each batch's records asked for when it is read)",
        bounds=(0, 256),
    )
    read_ahead_mib: int = setting(
        128,
        "MiB of records read ahead and not yet read by their streams, shared by all streams: "
        "bounds the reads in flight, about records/s x read latency x record size "
        "(default 128, for an NVMe disk)",
        bounds=(1, 65536),
    )
    max_batch_size: int = setting(
        1024, "largest batch a client may ask for (default 1024)", bounds=(1, 65536)
    )
    max_streams: int = setting(
        64, "concurrent streams before RESOURCE_EXHAUSTED (default 64)", bounds=(1, 4096)
    )
    max_idle_pipelines: int = setting(
        4,
        "built pipelines each pipeline slot keeps for the keys it runs (a key: pipeline, "
        "parameters, output format, batch size); more keys at once are rebuilt as they take "
        "turns (default 4)",
        bounds=(1, 256),
    )
    slots_per_device: int = setting(
        DEFAULT_SLOTS_PER_DEVICE,
        "pipeline slots each device runs for all streams and Preprocess requests, a pipeline "
        "at a time each; they do not grow with streams (default 2)",
        bounds=(1, 64),
    )
    pipelines_per_device: int | None = setting(
        None,
        "the former name of slots_per_device, still taken",
        bounds=(1, 64),
        deprecated=True,
    )
    metrics_port: int | None = setting(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics (default: off; 0: any free)",
        metavar="PORT",
        bounds=(0, 65535),
    )
    preprocess_batch_size: int = setting(
        64,
        "Preprocess RPC: images of concurrent requests per DALI batch (default 64)",
        bounds=(1, 4096),
    )
    preprocess_max_delay_ms: float = setting(
        5.0,
        "Preprocess RPC: how long a batch gathers images, in ms (default 5)",
        float,
        bounds=(0, 1000),
    )
    preprocess_max_queued: int = setting(
        1024,
        "Preprocess RPC: images that may wait before RESOURCE_EXHAUSTED (default 1024)",
        bounds=(1, 1048576),
    )
    max_request_bytes: int = setting(
        64 * 1024 * 1024,
        "largest request message, e.g. encoded images (default 64 MiB)",
        bounds=(65536, 1073741824),
    )
    # gRPC Python moves 8-16 MB messages fastest on loopback and slows sharply at 32 MB.
    max_message_bytes: int = setting(
        8 * 1024 * 1024,
        "larger batches travel as several messages of this size (default 8 MiB)",
        bounds=(65536, 1073741824),
    )
    shared_memory: bool = setting(
        True,
        "send batches to clients on this host through shared memory (a sealed memfd "
        "passed over a Unix socket), not in their messages (default on; "
        "--no-shared-memory: always in the messages)",
        boolean,
    )
    shared_memory_mib: int = setting(
        0,
        "MiB of shared memory the streams of this server (all its --workers together) "
        "may hold (default 0: a quarter of the host's or container's memory)",
        bounds=(0, 16777216),
    )
    shared_memory_socket_dir: pathlib.Path | None = setting(
        None,
        "make the Unix socket through which trainers claim shared memory in DIR, for "
        "trainers in other containers that mount DIR at the same path (default: a socket "
        "in the abstract namespace, reachable from the server's network namespace only)",
        _path,
        metavar="DIR",
    )
    bulk: bool = setting(
        True,
        "send each stream's images to trainers on other hosts on a TCP connection of its own "
        "beside the gRPC call, claimed with a one-time key, over TLS where the server has it "
        "(default on; --no-bulk: in the call's messages, slower)",
        boolean,
    )
    bulk_port: int = setting(
        0,
        "the port of the bulk connections (with --workers N: worker i's is PORT+i); "
        "trainers must reach it, else their images come in the messages (default 0: any "
        "free port, announced in each call)",
        metavar="PORT",
        bounds=(0, 65535),
    )
    grace: float = setting(
        30.0,
        "seconds in-flight streams get on SIGTERM or SIGINT (default 30)",
        float,
        bounds=(0, 86400),
    )
    rescan_interval: float = setting(
        5.0,
        "seconds between rescans of data_dir for datasets added, replaced (ingest "
        "--overwrite) or removed; SIGHUP rescans at once (default 5; 0: only on SIGHUP)",
        float,
        bounds=(0, 86400),
    )
    tls_cert: pathlib.Path | None = setting(
        None, "PEM certificate chain: serve TLS (needs tls_key)", _path, metavar="FILE"
    )
    tls_key: pathlib.Path | None = setting(
        None, "PEM private key of tls_cert, unencrypted", _path, metavar="FILE"
    )
    tls_client_ca: pathlib.Path | None = setting(
        None,
        "mutual TLS: require client certificates signed by this PEM CA",
        _path,
        metavar="FILE",
    )
    token_file: pathlib.Path | None = setting(
        None,
        "require 'authorization: Bearer <token>' with a token from FILE (one per line, # comments)",
        _path,
        metavar="FILE",
    )
    health_open: bool = setting(
        False, "with token_file: the health service needs no token (for probes)", boolean
    )
    pipelines: Mapping[str, PipelineSpec] = dataclasses.field(default_factory=_presets)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", pathlib.Path(self.data_dir))
        for name in (
            "tls_cert",
            "tls_key",
            "tls_client_ca",
            "token_file",
            "shared_memory_socket_dir",
        ):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str | os.PathLike):
                    raise ConfigError(f"{name} must be a path, got {value!r}")
                object.__setattr__(self, name, pathlib.Path(value))
        for each in settings():
            each.check(getattr(self, each.name))
        checks = (
            (
                all(isinstance(i, int) and i >= 0 for i in self.devices)
                and len(set(self.devices)) == len(self.devices),
                f"devices must be distinct GPU ids >= 0 (e.g. --devices 0,1), got {self.devices}",
            ),
            (
                not self.devices or self.device != "cpu",
                "devices picks GPUs: it cannot be combined with device = cpu "
                "(use --device auto or gpu, or leave --devices out)",
            ),
            (bool(self.pipelines), "at least one pipeline must be configured"),
            (
                (self.tls_cert is None) == (self.tls_key is None),
                "tls_cert and tls_key go together (--tls-cert FILE --tls-key FILE): "
                f"got only {'tls_cert' if self.tls_key is None else 'tls_key'}",
            ),
            (
                self.tls_client_ca is None or self.tls_cert is not None,
                "tls_client_ca (--tls-client-ca) needs TLS: give --tls-cert and --tls-key too",
            ),
            (isinstance(self.health_open, bool), "health_open must be true or false"),
            (isinstance(self.shared_memory, bool), "shared_memory must be true or false"),
            (isinstance(self.bulk, bool), "bulk must be true or false"),
            (
                not self.bulk_port or self.bulk_port + (self.workers or 1) - 1 <= 65535,
                f"with {self.workers} workers, the last bulk port would be "
                f"{self.bulk_port + (self.workers or 1) - 1}: pick a lower --bulk-port",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self._take_former_names()
        if self.read_workers:
            warnings.warn(
                "read_workers (--read-workers, BATCHWIRE_READ_WORKERS) is ignored and will be "
                "removed: every stream reads its records in the server's one record path; "
                "leave it out",
                FutureWarning,
                stacklevel=2,
            )

    def _take_former_names(self) -> None:
        """A setting given by its former name (``pipelines_per_device``) is the setting."""
        former = self.pipelines_per_device
        if former is None or former == self.slots_per_device:
            return
        if self.slots_per_device != DEFAULT_SLOTS_PER_DEVICE:
            raise ConfigError(
                f"slots_per_device ({self.slots_per_device}) and pipelines_per_device "
                f"({former}), its former name, say different things: give slots_per_device "
                "(--slots-per-device) alone"
            )
        object.__setattr__(self, "slots_per_device", former)


def settings() -> list[Setting]:
    """Every setting, in declaration order."""
    return declared(ServerConfig)
