"""The preset pipelines every server serves: ``train`` and ``val``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchwire.server.pipelines._spec import BuildContext, Param, ParamError, PipelineSpec

__all__ = ["PRESETS"]


def _train(encoded: Any, labels: Any, ctx: BuildContext, p: Mapping[str, float]) -> tuple[Any, Any]:
    """Fused decode + random crop, resize to ``size``, random flip, output cast."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    images = fn.decoders.image_random_crop(
        encoded,
        **ctx.decoder_args(),
        output_type=types.RGB,
        random_area=[p["area_min"], p["area_max"]],
        random_aspect_ratio=[p["aspect_min"], p["aspect_max"]],
        num_attempts=100,
    )
    size = int(p["size"])
    images = fn.resize(images, device=ctx.device, resize_x=size, resize_y=size, antialias=True)
    mirror = fn.random.coin_flip(probability=p["flip"])
    return ctx.finish(images, mirror=mirror), labels


def _val(encoded: Any, labels: Any, ctx: BuildContext, p: Mapping[str, float]) -> tuple[Any, Any]:
    """Decode, resize the shorter side to ``resize``, centre-crop ``size``, output cast."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    images = fn.decoders.image(encoded, **ctx.decoder_args(), output_type=types.RGB)
    images = fn.resize(images, device=ctx.device, resize_shorter=p["resize"], antialias=True)
    size = int(p["size"])
    return ctx.finish(images, crop=(size, size)), labels


def _check_train(p: Mapping[str, float]) -> None:
    if p["area_min"] > p["area_max"]:
        raise ParamError("train: area_min must not exceed area_max")
    if p["aspect_min"] > p["aspect_max"]:
        raise ParamError("train: aspect_min must not exceed aspect_max")


def _check_val(p: Mapping[str, float]) -> None:
    if p["size"] > p["resize"]:
        raise ParamError("val: the crop size must not exceed the resize of the shorter side")


_SIZE = Param(default=224, low=8, high=1024, integer=True, help="output height and width")

PRESETS: dict[str, PipelineSpec] = {
    "train": PipelineSpec(
        name="train",
        function=_train,
        description="decode + random-resized-crop, resize to size, horizontal flip, normalize",
        params={
            "size": _SIZE,
            "area_min": Param(default=0.08, low=0.01, high=1.0, help="smallest crop area fraction"),
            "area_max": Param(default=1.0, low=0.01, high=1.0, help="largest crop area fraction"),
            "aspect_min": Param(default=3 / 4, low=0.1, high=10.0, help="smallest aspect ratio"),
            "aspect_max": Param(default=4 / 3, low=0.1, high=10.0, help="largest aspect ratio"),
            "flip": Param(default=0.5, low=0.0, high=1.0, help="horizontal flip probability"),
        },
        check=_check_train,
    ),
    "val": PipelineSpec(
        name="val",
        function=_val,
        description="decode, resize shorter side to resize, centre crop size, normalize",
        params={
            "size": _SIZE,
            "resize": Param(default=256, low=8, high=4096, integer=True, help="shorter side"),
        },
        check=_check_val,
    ),
}
