"""A pipeline that fails for a reason other than a bad sample is a fault: the stream ends
UNAVAILABLE and the loader resumes elsewhere; bad samples are found by bisection and skipped.

The faults are real: custom pipelines written here whose DALI graph raises
(``fn.python_function``) on every batch, on batches above a size, or on chosen samples.
"""

from __future__ import annotations

import logging
import pathlib
import re
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from conftest import start_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from processes import serve_process
from test_resources import within

from batchwire.client import RemoteLoader
from batchwire.client._transport import CHANNEL_OPTIONS
from batchwire.common.sampler import Plan
from batchwire.server import BatchwireServer, load_file, pipelines_from_config
from batchwire.server.data import Dataset
from batchwire.server.errors import PipelineFault
from batchwire.server.pipelines import PRESETS, BuildContext, OutputSpec, PipelineSpec
from batchwire.server.runners import (
    FAULTS_IN_A_ROW,
    Job,
    PipelineHealth,
    Runner,
    RunnerKey,
    keep,
)
from batchwire.server.runners._dali import fault_kind
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc

# The test's custom pipelines: the `val` preset, then an operator that fails.
FAULTY = '''
import nvidia.dali.fn as fn

from batchwire.server.pipelines import PRESETS


def _device_lost(images):
    raise RuntimeError("injected: the accelerator stopped answering")


def _refuse_large(images):
    if len(images) > 4:
        raise RuntimeError("injected: this batch does not fit")
    return images


def broken(encoded, labels, ctx, params):
    """Fails on every batch, whatever its samples."""
    images, labels = PRESETS["val"].function(encoded, labels, ctx, params)
    return fn.python_function(images, function=_device_lost), labels


def small_batches_only(encoded, labels, ctx, params):
    """Fails on any batch of more than 4 samples; each sample alone runs."""
    images, labels = PRESETS["val"].function(encoded, labels, ctx, params)
    return fn.python_function(images, function=_refuse_large, batch_processing=True), labels


def unbuildable(encoded, labels, ctx, params):
    raise ValueError("injected: this graph cannot be built")
'''

VAL_PARAMS = """
[pipelines.{name}.params]
size = {{ default = 224, low = 8, high = 1024, integer = true }}
resize = {{ default = 256, low = 8, high = 4096, integer = true }}
"""

OPTIONS = {
    "dataset": "shapes",
    "pipeline": "flaky",
    "batch_size": 8,
    "return_ids": True,
    "params": {"size": 32},
    "seed": 3,
    "drop_last": False,
}
EXPECTED = Plan(num_samples=520, batch_size=8, seed=3, drop_last=False).share().tolist()


def write_config(directory: pathlib.Path, name: str, flaky: str) -> pathlib.Path:
    """A config serving `val` (warmed up first) and `flaky`: the preset when ``flaky`` is
    "preset", else the custom function of that name in faulty.py."""
    (directory / "faulty.py").write_text(FAULTY)
    config = directory / f"{name}.toml"
    text = '[pipelines.val]\npreset = "val"\n\n[pipelines.flaky]\n'
    if flaky == "preset":
        text += 'preset = "val"\n'
    else:
        text += f'function = "faulty.py:{flaky}"\n' + VAL_PARAMS.format(name="flaky")
    config.write_text(text)
    return config


def status(target: str) -> dict[str, int]:
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        return {
            service: health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            for service in ("", "batchwire.v1.Batchwire")
        }


def test_a_pipeline_that_fails_on_one_server_fails_over_and_the_epoch_is_exact(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.client")
    broken = write_config(tmp_path, "a", "broken")
    working = write_config(tmp_path, "b", "preset")
    with (
        serve_process(data_dir, tmp_path / "a.log", "--config", str(broken)) as a,
        serve_process(data_dir, tmp_path / "b.log", "--config", str(working)) as b,
        RemoteLoader([a.address, b.address], retry_timeout=60, **OPTIONS) as loader,  # type: ignore[arg-type]
    ):
        steps, ids = 0, []
        for _, _, batch_ids in loader:
            steps += 1
            ids += batch_ids.tolist()
        assert steps == len(loader)
        assert ids == EXPECTED  # every id once, in order, though server a failed every batch
        assert loader.skipped_ids == []  # a fault is not a bad sample
        failed = re.compile(
            rf"{a.address} failed \(.*UNAVAILABLE: the server's pipeline 'flaky' failed"
        )
        assert any(failed.search(r.getMessage()) for r in caplog.records), caplog.text
    log = a.log.read_text()
    assert "injected: the accelerator stopped answering" in log
    assert "skipping sample" not in log


@pytest.fixture(scope="module")
def faulty_server(
    data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BatchwireServer]:
    directory = tmp_path_factory.mktemp("faulty")
    config = write_config(directory, "faulty", "broken")
    table = load_file(config)["pipelines"]
    table["unbuildable"] = {"function": "faulty.py:unbuildable"}
    pipelines = pipelines_from_config(table, base_dir=directory)
    server = start_server(data_dir, pipelines=pipelines, num_threads=1)
    yield server
    server.stop(grace=1.0)


def metric(server: BatchwireServer, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in server.metrics.registry.collect()
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def stream_status(target: str, pipeline: str) -> tuple[grpc.StatusCode, str]:
    """How a StreamBatches call of ``pipeline`` ends."""
    params = {} if pipeline == "unbuildable" else {"size": 32}
    request = pb.StreamBatchesRequest(
        dataset="shapes", pipeline=pipeline, batch_size=8, params=params
    )
    with grpc.insecure_channel(target) as channel:
        try:
            for _ in pb_grpc.BatchwireStub(channel).StreamBatches(request, timeout=120):
                pass
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def test_a_server_whose_pipelines_keep_failing_is_not_serving_until_one_runs(
    faulty_server: BatchwireServer,
) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert set(status(faulty_server.target).values()) == {serving}
    for _ in range(3):  # three faults in a row, no batch run between them
        code, details = stream_status(faulty_server.target, "flaky")
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "pipeline" in details and "another server" in details
    assert set(status(faulty_server.target).values()) == {not_serving}
    assert metric(faulty_server, "batchwire_device_healthy") == 0
    assert metric(faulty_server, "batchwire_pipeline_faults_total", kind="control") >= 3
    assert metric(faulty_server, "batchwire_batches_failed_total", pipeline="flaky") >= 3
    # A batch that runs on the device again: it serves again.
    assert stream_status(faulty_server.target, "val")[0] == grpc.StatusCode.OK
    assert set(status(faulty_server.target).values()) == {serving}
    assert metric(faulty_server, "batchwire_device_healthy") == 1


def test_a_pipeline_that_cannot_be_built_ends_each_call_unavailable_never_unknown(
    faulty_server: BatchwireServer, data_dir: pathlib.Path
) -> None:
    code, details = stream_status(faulty_server.target, "unbuildable")
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "cannot be built" in details
    with grpc.insecure_channel(faulty_server.target) as channel:
        stub = pb_grpc.BatchwireStub(channel)
        share = pb.StreamBatchesRequest(dataset="shapes", pipeline="unbuildable", batch_size=8)
        with pytest.raises(grpc.RpcError) as pulled:
            list(stub.PullBatches(iter([pb.PullRequest(stream=share, batches=[0])]), timeout=60))
        assert pulled.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        with Dataset(data_dir / "shapes") as dataset:
            images, _ = dataset.read([0, 1])
        with pytest.raises(grpc.RpcError) as preprocessed:
            stub.Preprocess(
                pb.PreprocessRequest(pipeline="unbuildable", images=[bytes(i) for i in images]),  # type: ignore[arg-type]
                timeout=60,
            )
        assert preprocessed.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert metric(faulty_server, "batchwire_pipeline_faults_total", kind="build") >= 1


def test_a_call_the_server_ends_unavailable_is_not_made_there_again(
    faulty_server: BatchwireServer, data_dir: pathlib.Path
) -> None:
    # The client's channels make a call that only asks again when it ends UNAVAILABLE (a
    # connection that failed), but not when the server itself ended it so: that says
    # "elsewhere" (a pipeline fault here, a drain).
    with Dataset(data_dir / "shapes") as dataset:
        images, _ = dataset.read([0, 1])
    request = pb.PreprocessRequest(pipeline="unbuildable", images=[bytes(i) for i in images])  # type: ignore[arg-type]
    method = "/batchwire.v1.Batchwire/Preprocess"

    def ended() -> float:
        return metric(faulty_server, "batchwire_errors_total", method=method, code="UNAVAILABLE")

    before = ended()
    with grpc.insecure_channel(faulty_server.target, options=CHANNEL_OPTIONS) as channel:
        with pytest.raises(grpc.RpcError) as preprocessed:
            pb_grpc.BatchwireStub(channel).Preprocess(request, timeout=60)
        assert preprocessed.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    # abort() sends the status before the interceptor counts the call: poll.
    assert within(30, lambda: ended() > before)
    assert ended() == before + 1


def test_a_stream_whose_pipeline_cannot_be_built_is_unavailable(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    (tmp_path / "faulty.py").write_text(FAULTY)
    pipelines = pipelines_from_config(
        {"val": {"preset": "val"}, "unbuildable": {"function": "faulty.py:unbuildable"}},
        base_dir=tmp_path,
    )
    server = start_server(data_dir, pipelines=pipelines)
    try:
        code, details = stream_status(server.target, "unbuildable")
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "cannot be built" in details and "another server" in details
    finally:
        server.stop(grace=1.0)


# -- the runner: bisection, and faults that are not about a sample ----------------------


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PipelineSpec]:
    """The val preset and faulty.py's pipelines, as a server config names them."""
    directory = tmp_path_factory.mktemp("specs")
    (directory / "faulty.py").write_text(FAULTY)
    table = {name: {"function": f"faulty.py:{name}"} for name in ("broken", "small_batches_only")}
    return {"val": PRESETS["val"], **pipelines_from_config(table, base_dir=directory)}


def runner(spec: PipelineSpec, health: PipelineHealth) -> Runner:
    """A runner of ``spec`` for batches of 16 at size 32 on the CPU."""
    params = (("resize", 32.0), ("size", 32.0))
    key = RunnerKey(spec.name, params, "uint8", "NCHW", 16, "cpu", None)
    ctx = BuildContext(device="cpu", output=OutputSpec())
    return Runner(key, spec, ctx, num_threads=1, prefetch=2, health=health)


def truncated(image: np.ndarray) -> np.ndarray:
    """A JPEG cut short, handed to the runner as is (the server's screen would skip it):
    DALI's CPU decoder fails on it."""
    return image[: len(image) // 2].copy()


def jobs(data_dir: pathlib.Path, count: int, bad: dict[int, set[int]]) -> list[Job]:
    """``count`` jobs of 16 samples; the positions in ``bad[seq]`` cut short."""
    with Dataset(data_dir / "shapes") as dataset:
        out = []
        for seq in range(count):
            ids = np.arange(seq * 16, seq * 16 + 16)
            images, labels = dataset.read(ids)
            damaged = [
                truncated(image) if i in bad.get(seq, ()) else image  # type: ignore[arg-type]
                for i, image in enumerate(images)
            ]
            out.append(Job(seq=seq, ids=ids, images=damaged, labels=labels))  # type: ignore[arg-type]
    return out


def test_bisection_finds_every_culprit_of_a_batch(
    data_dir: pathlib.Path, specs: dict[str, PipelineSpec]
) -> None:
    health = PipelineHealth()
    bad = {1: {0, 5, 6, 15}, 2: set(range(16))}
    results = [keep(r) for r in runner(specs["val"], health).run(iter(jobs(data_dir, 4, bad)))]
    assert [r.seq for r in results] == [0, 1, 2, 3]
    for result in results:
        culprits = {result.seq * 16 + i for i in bad.get(result.seq, ())}
        assert set(result.skipped_ids) == culprits
        assert (
            set(result.ids.tolist()) == set(range(result.seq * 16, result.seq * 16 + 16)) - culprits
        )
        assert result.images.shape == (16 - len(culprits), 3, 32, 32)
    # A batch of nothing but bad samples is empty, with the pipeline's trailing shape.
    assert results[2].images.shape == (0, 3, 32, 32)
    assert health.faults() == {}


def test_a_pipeline_that_fails_on_every_sample_is_a_fault_not_skipped_samples(
    data_dir: pathlib.Path, specs: dict[str, PipelineSpec]
) -> None:
    health = PipelineHealth()
    assert len(list(runner(specs["val"], health).run(iter(jobs(data_dir, 1, {}))))) == 1
    with pytest.raises(PipelineFault, match="accelerator stopped answering") as caught:
        list(runner(specs["broken"], health).run(iter(jobs(data_dir, 2, {}))))
    assert caught.value.kind == "control"
    assert health.faults() == {("broken", "control"): 1}


def test_a_batch_that_fails_though_its_samples_run_is_a_fault(
    data_dir: pathlib.Path, specs: dict[str, PipelineSpec]
) -> None:
    health = PipelineHealth()
    with pytest.raises(PipelineFault, match="does not fit") as caught:
        list(runner(specs["small_batches_only"], health).run(iter(jobs(data_dir, 1, {}))))
    assert caught.value.kind == "batch"


# -- which failures are faults, and when a device is broken -------------------------------


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("CUDA runtime API error cudaErrorIllegalAddress (700):\nan illegal memory access", "cuda"),
        ("CUDA driver API error CUDA_ERROR_LAUNCH_FAILED (719)", "cuda"),
        ("CUDA runtime API error cudaErrorMemoryAllocation (2):\nout of memory", "out_of_memory"),
        ("CUDA allocation failed", "out_of_memory"),
        ("Can't allocate 1073741824 bytes on device 0.", "out_of_memory"),
        ("std::bad_alloc", "out_of_memory"),
        (
            "Error in CPU operator `decoders.image`\nencountered:\n\nFailed to decode sample #0 : ",
            None,
        ),
        ("DLTensorPythonFunction error: RuntimeError: injected", None),
    ],
)
def test_failures_that_no_sample_causes_are_told_by_dalis_words(
    message: str, kind: str | None
) -> None:
    assert fault_kind(RuntimeError(message)) == kind


def key_on(device: int | None) -> RunnerKey:
    return RunnerKey("train", (), "uint8", "NCHW", 8, "gpu", device)


def test_a_device_is_broken_after_faults_in_a_row_until_a_batch_runs_there() -> None:
    health = PipelineHealth((0, 1))
    changes: list[dict[str, str]] = []
    health.listen(lambda: changes.append(health.broken()))
    image, images = np.zeros(10, np.uint8), np.zeros((8, 3, 4, 4), np.uint8)
    fault = PipelineFault("train", "batch", "injected")
    for _ in range(FAULTS_IN_A_ROW - 1):
        health.failed(key_on(0), fault, batches=2)
    health.ran(key_on(0), images, image, 1)  # a batch between: the count starts again
    for _ in range(FAULTS_IN_A_ROW - 1):
        health.failed(key_on(0), fault, batches=2)
    health.ran(key_on(1), images, image, 1)  # another device's batch does not count
    assert health.broken() == {}
    health.failed(key_on(0), fault, batches=2)
    assert list(health.broken()) == ["0"] and changes == [health.broken()]
    assert health.devices() == {"0": False, "1": True}
    health.ran(key_on(0), images, image, 1)
    assert health.broken() == {} and changes[-1] == {}
    assert health.faults() == {("train", "batch"): 2 * FAULTS_IN_A_ROW - 1}
    assert health.batches_failed() == {"train": 2 * (2 * FAULTS_IN_A_ROW - 1)}


def test_a_cuda_error_breaks_its_device_for_good() -> None:
    health = PipelineHealth((0, 1))
    health.failed(key_on(1), PipelineFault("train", "cuda", "cudaErrorIllegalAddress"), 1)
    assert "restart the server" in health.broken()["1"]
    health.ran(key_on(1), np.zeros((8, 3, 4, 4), np.uint8), np.zeros(10, np.uint8), 1)
    assert list(health.broken()) == ["1"]  # a CUDA context does not recover
