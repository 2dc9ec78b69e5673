"""Pipelines with several named outputs, against a real server: DINO's views from the
``multicrop`` preset, and a custom pipeline's fixed and ragged outputs byte-identical in the
messages, in shared memory and on the bulk connection; the contract (ids, order, resume) as
for images and labels."""

from __future__ import annotations

import pathlib
import shutil
import signal
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import class_of, start_server
from processes import serve_process
from test_corrupt import bad_huffman_table, corrupt

from batchwire.client import InvalidArgumentError, RemoteLoader
from batchwire.common.sampler import Plan
from batchwire.server import BatchwireServer, ConfigError, load_file, pipelines_from_config
from batchwire.server.data import Manifest
from batchwire.server.pipelines import PRESETS, BuildContext, Output, PipelineSpec
from batchwire.v1 import datum_pb2

BATCH = 40  # 520 samples: 13 batches
SIZES = {"global_size": 32, "local_size": 16}


def _pair(encoded: Any, labels: Any, ctx: BuildContext, p: Any) -> dict[str, Any]:
    """A deterministic pipeline of three outputs: a centre crop at two sizes, and each
    sample's encoded bytes as they were read (ragged: their lengths differ)."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    images = fn.decoders.image(encoded, **ctx.decoder_args(), output_type=types.RGB)
    small = fn.resize(images, device=ctx.device, resize_shorter=24, antialias=True)
    large = fn.resize(images, device=ctx.device, resize_shorter=48, antialias=True)
    return {
        "small": ctx.finish(small, crop=(24, 24)),
        "large": ctx.finish(large, crop=(40, 40)),
        "encoded": encoded,
    }


PAIR = PipelineSpec(
    name="pair",
    function=_pair,
    params={},
    outputs=(Output(name="small"), Output(name="large"), Output(name="encoded", kind="ragged")),
)


@pytest.fixture(scope="module")
def server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    server = start_server(data_dir, pipelines={**PRESETS, "pair": PAIR})
    yield server
    server.stop(grace=1.0)


OPTIONS: dict[str, Any] = {
    "dataset": "shapes",
    "pipeline": "multicrop",
    "batch_size": BATCH,
    "return_ids": True,
    "params": SIZES,
    "seed": 3,
}


def make(server: BatchwireServer, **kwargs: Any) -> RemoteLoader:
    return RemoteLoader(server.target, **{**OPTIONS, **kwargs})


def share(epoch: int) -> list[int]:
    plan = Plan(num_samples=520, batch_size=BATCH, seed=3, epoch=epoch, drop_last=False)
    return plan.share().tolist()


def test_multicrop_gives_dinos_views_of_every_sample_in_order(
    server: BatchwireServer, shapes_manifest: Manifest
) -> None:
    """Two global views and eight local ones of each sample, at their declared sizes,
    normalized on the trainer; the views of one sample differ; every sample once, in the
    epoch's order, with its own label."""
    ids: list[int] = []
    with make(server) as loader:
        for views, labels, batch_ids in loader:
            assert isinstance(views, list) and len(views) == 10
            n = len(batch_ids)
            assert [tuple(v.shape) for v in views] == [(n, 3, 32, 32)] * 2 + [(n, 3, 16, 16)] * 8
            assert all(v.dtype == torch.float32 for v in views)
            assert not torch.equal(views[0], views[1])  # each view its own crop and jitter
            assert not torch.equal(views[2], views[3])
            assert labels.tolist() == class_of(shapes_manifest, batch_ids.numpy()).tolist()
            ids += batch_ids.tolist()
    assert ids == share(0)


def head_and_rest(make: Callable[[], RemoteLoader], cut: int) -> list[int]:
    """The ids of the first ``cut`` batches of a loader ``make`` gives (whatever a batch's
    form, its ids last), then of the rest of that epoch from a new one loaded with its
    state."""
    loader = make()
    head = [i for _, batch in zip(range(cut), loader, strict=False) for i in batch[-1].tolist()]
    state = loader.state_dict()
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    rest = [i for batch in resumed for i in batch[-1].tolist()]
    resumed.close()
    return head + rest


def test_a_multicrop_state_resumes_exactly_the_rest_of_the_epoch(server: BatchwireServer) -> None:
    assert head_and_rest(lambda: make(server), 4) == share(0)


def _epoch(server: BatchwireServer, **transport: bool) -> list[tuple[Any, ...]]:
    with make(server, pipeline="pair", params={}, normalize=False, **transport) as loader:
        return list(loader)


def test_named_outputs_are_byte_identical_over_every_transport(
    server: BatchwireServer,
) -> None:
    """The pair pipeline's outputs in the messages, in shared memory and on the bulk
    connection: the same bytes; its crop the val pipeline's at that size; its ragged output
    each sample's encoded bytes."""
    messages = _epoch(server, shared_memory=False, bulk=False)
    shared = _epoch(server)
    bulk = _epoch(server, shared_memory=False)
    assert len(messages) == 13
    for (a, la, ia), (b, lb, ib), (c, lc, ic) in zip(messages, shared, bulk, strict=True):
        assert sorted(a) == ["encoded", "large", "small"]
        assert torch.equal(ia, ib) and torch.equal(ia, ic)
        assert torch.equal(la, lb) and torch.equal(la, lc)
        for name in ("small", "large"):
            assert a[name].dtype == torch.uint8
            assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name])
        assert a["small"].shape == (len(ia), 3, 24, 24) and a["large"].shape[2:] == (40, 40)
        assert len(a["encoded"]) == len(ia)
        for x, y, z in zip(a["encoded"], b["encoded"], c["encoded"], strict=True):
            assert torch.equal(x, y) and torch.equal(x, z)
            assert bytes(x[:2].tolist()) == b"\xff\xd8"  # a JPEG, whole: it ends as one
            assert bytes(x[-2:].tolist()) == b"\xff\xd9"
    with make(server, pipeline="val", params={"size": 24, "resize": 24}, normalize=False) as val:
        first = next(iter(val))[0]
    assert torch.equal(first, messages[0][0]["small"])
    ids = [i for _, _, batch in messages for i in batch.tolist()]
    assert ids == share(0)


def test_preprocess_refuses_a_pipeline_of_named_outputs(server: BatchwireServer) -> None:
    from batchwire.client import Preprocessor

    with (
        Preprocessor(server.target, pipeline="multicrop") as preprocessor,
        pytest.raises(InvalidArgumentError, match="several named outputs"),
    ):
        preprocessor([b"\xff\xd8\xff\xd9"])


def test_corrupt_records_are_left_out_of_every_view_and_an_empty_batch_keeps_its_views(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Records that cannot be decoded are skipped and reported as with one output; a batch
    whose every record is bad comes with its ten views, each of no sample, so that every
    rank takes the same steps."""
    copy = tmp_path / "datasets"
    shutil.copytree(data_dir, copy)
    dataset = copy / "shapes"
    rng = np.random.default_rng(3)
    # shuffle=False: batch k of 8 holds ids 8k .. 8k + 7; batch 2 all bad, two more elsewhere.
    damage = {i: bad_huffman_table(dataset, i) for i in range(16, 24)}
    damage[3] = datum_pb2.Datum(encoded=True, label=0, data=rng.bytes(900)).SerializeToString()
    damage[41] = bad_huffman_table(dataset, 41)
    corrupt(dataset, damage)
    server = start_server(copy)
    try:
        with make(server, batch_size=8, shuffle=False) as loader:
            batches = list(loader)
            skipped = sorted(loader.skipped_ids)
    finally:
        server.stop(grace=1.0)
    assert len(batches) == 65 and skipped == sorted(damage)
    views, labels, ids = batches[2]
    assert len(views) == 10 and labels.shape == (0,) and ids.shape == (0,)
    # Of no sample; of the views' shapes once a pipeline of this configuration ran a batch on
    # the server (in any slot), else (0,) (docs/client.md: Empty batches).
    assert all(v.shape[0] == 0 for v in views)
    assert all(tuple(v.shape) in ((0,), (0, 3, 32, 32)) for v in views[:2])
    assert all(tuple(v.shape) in ((0,), (0, 3, 16, 16)) for v in views[2:])
    delivered = [i for _, _, batch in batches for i in batch.tolist()]
    assert delivered == [i for i in range(520) if i not in damage]


def test_views_survive_a_server_sigkilled_mid_epoch(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Two server processes, one SIGKILLed after 5 batches: every sample of the epoch once,
    in order, each with its ten views."""
    with (
        serve_process(data_dir, tmp_path / "a.log") as a,
        serve_process(data_dir, tmp_path / "b.log") as b,
    ):
        ids: list[int] = []
        with RemoteLoader([a.address, b.address], **OPTIONS, retry_timeout=30) as loader:
            for n, (views, _, batch) in enumerate(loader):
                assert len(views) == 10 and all(len(v) == len(batch) for v in views)
                ids += batch.tolist()
                if n == 4:
                    a.process.send_signal(signal.SIGKILL)
    assert ids == share(0)


PAIR_MODULE = """
import nvidia.dali.fn as fn
import nvidia.dali.types as types


def pair(encoded, labels, ctx, params):
    images = fn.decoders.image(encoded, **ctx.decoder_args(), output_type=types.RGB)
    small = fn.resize(images, device=ctx.device, resize_x=24, resize_y=24)
    return {"small": ctx.finish(small), "encoded": encoded}


def sized(encoded, labels, ctx, params, fields):
    return {"boxes": fields["boxes"]}
"""


def test_a_config_declares_outputs_and_inputs(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """[pipelines.*] outputs, form and inputs, as docs/server.md shows them: served as
    declared; a malformed declaration names the pipeline."""
    (tmp_path / "pairs.py").write_text(PAIR_MODULE)
    config = tmp_path / "pairs.toml"
    config.write_text(
        "[pipelines.pair]\n"
        'function = "pairs.py:pair"\n'
        'outputs = ["small", { name = "encoded", kind = "ragged" }]\n'
        "[pipelines.sized]\n"
        'function = "pairs.py:sized"\n'
        'outputs = [{ name = "boxes", kind = "ragged" }]\n'
        'inputs = [{ name = "boxes", kind = "float" }]\n'
    )
    pipelines = pipelines_from_config(load_file(config)["pipelines"], base_dir=tmp_path)
    assert [(o.name, o.kind) for o in pipelines["pair"].outputs] == [
        ("small", "image"),
        ("encoded", "ragged"),
    ]
    assert pipelines["pair"].form == "named" and pipelines["sized"].inputs[0].kind == "float"
    server = start_server(data_dir, pipelines=pipelines)
    try:
        with make(server, pipeline="pair", params={}, normalize=False) as loader:
            outputs, labels, ids = next(iter(loader))
        assert len(labels) == len(ids) == BATCH
        assert outputs["small"].shape == (BATCH, 3, 24, 24) and len(outputs["encoded"]) == BATCH
        with (
            make(server, pipeline="sized", params={}) as loader,
            pytest.raises(InvalidArgumentError, match="'sized' takes the field 'boxes'"),
        ):
            next(iter(loader))
    finally:
        server.stop(grace=1.0)
    for bad, words in {
        'outputs = [{ title = "x" }]': "an output is a name or a table",
        'outputs = ["x"]\nform = "pictures"': "form must be one of",
        'inputs = [{ name = "boxes", kind = "box" }]': "kind must be one of",
        'inputs = ["boxes"]': "an input is a table of name and kind",
    }.items():
        config.write_text(f'[pipelines.x]\nfunction = "pairs.py:pair"\n{bad}\n')
        with pytest.raises(ConfigError, match=r"\[pipelines\.x\]") as caught:
            pipelines_from_config(load_file(config)["pipelines"], base_dir=tmp_path)
        assert words in str(caught.value)
