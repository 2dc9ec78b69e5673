"""StreamSpec: the one declaration of a stream's parameters, and its wire form."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchwire.common.mixture import MixturePlan, mixture_order
from batchwire.common.stream import LIMITS, MAX_SOURCES, Source, StreamSpec
from batchwire.v1 import batchwire_pb2 as pb

specs = st.builds(
    lambda world, data: StreamSpec(
        dataset=data.draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)),
        pipeline=data.draw(st.sampled_from(["train", "val", "my.pipe-1"])),
        batch_size=data.draw(st.integers(1, 4096)),
        seed=data.draw(st.integers(0, LIMITS["seed"])),
        epoch=data.draw(st.integers(0, LIMITS["epoch"])),
        shuffle=data.draw(st.booleans()),
        drop_last=data.draw(st.booleans()),
        world_size=world,
        rank=data.draw(st.integers(0, world - 1)),
        start=data.draw(st.integers(0, 10**9)),
        dtype=data.draw(st.sampled_from(["uint8", "float16", "float32"])),
        layout=data.draw(st.sampled_from(["NCHW", "NHWC"])),
        params=data.draw(st.dictionaries(st.sampled_from(["size", "min_area"]), st.floats(0, 1e3))),
    ),
    st.integers(1, 64),
    st.data(),
)


@given(specs)
def test_a_spec_survives_the_wire_unchanged(spec: StreamSpec) -> None:
    wire = pb.StreamBatchesRequest.FromString(spec.to_proto().SerializeToString())
    assert StreamSpec.from_proto(wire) == spec


def test_fields_a_client_leaves_unset_take_the_defaults() -> None:
    spec = StreamSpec.from_proto(pb.StreamBatchesRequest(dataset="d", pipeline="p", batch_size=8))
    assert spec == StreamSpec(dataset="d", pipeline="p", batch_size=8)
    assert (spec.shuffle, spec.drop_last, spec.world_size) == (True, True, 1)
    assert (spec.dtype, spec.layout) == ("uint8", "NCHW")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"rank": 3, "world_size": 3}, "rank"),
        ({"dataset": ""}, "dataset must be named"),
        ({"pipeline": "a/b"}, "not a valid name"),
        ({"dtype": "int8"}, "dtype"),
        ({"layout": "CHW"}, "layout"),
        ({"world_size": LIMITS["world_size"] + 1}, "world_size must be at most"),
        ({"params": {"size": float("inf")}}, "finite"),
    ],
)
def test_an_invalid_spec_names_its_field(change: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        StreamSpec(**{"dataset": "d", "batch_size": 4, **change})  # type: ignore[arg-type]


def test_a_spec_is_frozen_and_its_plan_is_the_contracts() -> None:
    spec = StreamSpec(dataset="d", batch_size=4, seed=7, epoch=2, rank=1, world_size=2, start=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.batch_size = 5  # type: ignore[misc]
    plan = spec.plan(40)
    assert (plan.seed, plan.epoch, plan.rank, plan.world_size, plan.start) == (7, 2, 1, 2, 4)
    assert plan.num_batches == 5 and [b.index for b in plan.batches()] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="start"):
        spec.replace(start=21).plan(40)


def test_a_mixtures_sources_survive_the_wire_and_plan_its_order() -> None:
    sources = (Source("web", 70, "ab12"), Source("curated", 30))
    spec = StreamSpec(sources=sources, batch_size=8, seed=4, epoch=1, rank=1, world_size=2)
    wire = pb.StreamBatchesRequest.FromString(spec.to_proto().SerializeToString())
    assert StreamSpec.from_proto(wire) == spec
    assert spec.datasets == ("web", "curated") and spec.name == "web+curated"
    plan = spec.plan([200, 10])  # curated upsampled three times, web a subset
    assert isinstance(plan, MixturePlan) and plan.num_samples == 100
    mixed = plan.order()
    assert mixed.tolist() == mixture_order(4, 1, (200, 10), (70, 30)).tolist()
    assert [b.ids.tolist() for b in plan.batches()] == [
        mixed[1::2][k : k + 8].tolist() for k in range(0, 48, 8)
    ]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"dataset": "web"}, "leave dataset and dataset_version empty"),
        ({"sources": (Source("web", 1), Source("web", 2))}, "named more than once"),
        ({"sources": (Source("web", 0),)}, "1 to"),
        ({"sources": tuple(Source(f"d{i}", 1) for i in range(MAX_SOURCES + 1))}, "at most"),
    ],
)
def test_an_invalid_mixture_says_what_is_wrong(change: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        StreamSpec(**{"sources": (Source("web", 4),), "batch_size": 4, **change})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("source", "words"),
    [
        (("a/b", 1), "not a valid name"),
        (("web", -1), "count must be a whole number"),
        (("web", 1, "xyz"), "hex digits"),
    ],
)
def test_an_invalid_source_says_what_is_wrong(source: tuple[Any, ...], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Source(*source)


def test_a_mixture_plans_only_on_its_sources_sizes() -> None:
    spec = StreamSpec(sources=(Source("web", 4), Source("curated", 2)), batch_size=2)
    with pytest.raises(ValueError, match="1 sizes for a mixture of 2 sources"):
        spec.plan(10)
    with pytest.raises(ValueError, match="source 1 is empty"):
        spec.plan([10, 0])
