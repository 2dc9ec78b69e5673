"""The preset pipelines every server serves: ``train`` and ``val`` (classification),
``multicrop`` (self-supervised views), ``detection``, ``segmentation`` and ``captions``
(samples with fields)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from batchwire.server.pipelines._spec import (
    BuildContext,
    Input,
    Output,
    Param,
    ParamError,
    PipelineSpec,
)

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
        **ctx.rng(),
    )
    size = int(p["size"])
    images = fn.resize(images, device=ctx.device, resize_x=size, resize_y=size, antialias=True)
    mirror = fn.random.coin_flip(probability=p["flip"], **ctx.rng())
    return ctx.finish(images, mirror=mirror), labels


def _val(encoded: Any, labels: Any, ctx: BuildContext, p: Mapping[str, float]) -> tuple[Any, Any]:
    """Decode, resize the shorter side to ``resize``, centre-crop ``size``, output cast."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    images = fn.decoders.image(encoded, **ctx.decoder_args(), output_type=types.RGB)
    images = fn.resize(images, device=ctx.device, resize_shorter=p["resize"], antialias=True)
    size = int(p["size"])
    return ctx.finish(images, crop=(size, size)), labels


# multicrop: DINO's views (Caron et al. 2021, its defaults): two global crops and eight
# local ones, each its own random-resized crop, flip and colour jitter.
_GLOBAL_VIEWS, _LOCAL_VIEWS = 2, 8
_MULTICROP_OUTPUTS = tuple(
    Output(name=f"{kind}_{n}")
    for kind, count in (("global", _GLOBAL_VIEWS), ("local", _LOCAL_VIEWS))
    for n in range(count)
)


def _jitter(images: Any, ctx: BuildContext, p: Mapping[str, float]) -> Any:
    """torchvision's ``RandomApply([ColorJitter(b, c, s, h)], p=jitter)`` then
    ``RandomGrayscale(grayscale)``, per sample: a factor drawn where the coin says so, 1
    (no change) elsewhere."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    apply = fn.cast(fn.random.coin_flip(probability=p["jitter"], **ctx.rng()), dtype=types.FLOAT)
    gray = fn.cast(fn.random.coin_flip(probability=p["grayscale"], **ctx.rng()), dtype=types.FLOAT)

    def factor(spread: float) -> Any:
        drawn = fn.random.uniform(range=[max(0.0, 1.0 - spread), 1.0 + spread], **ctx.rng())
        return 1.0 + apply * (drawn - 1.0)

    hue = apply * fn.random.uniform(range=[-p["hue"] * 360.0, p["hue"] * 360.0], **ctx.rng())
    return fn.color_twist(
        images,
        device=ctx.device,
        brightness=factor(p["brightness"]),
        contrast=factor(p["contrast"]),
        saturation=factor(p["saturation"]) * (1.0 - gray),
        hue=hue,
    )


def _multicrop(
    encoded: Any, labels: Any, ctx: BuildContext, p: Mapping[str, float]
) -> dict[str, Any]:
    """Decode once; then each view its own random-resized crop (global: ``global_size``,
    area ``[global_area_min, global_area_max]``; local: ``local_size``, area
    ``[local_area_min, local_area_max]``), colour jitter, grayscale and flip."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    images = fn.decoders.image(encoded, **ctx.decoder_args(), output_type=types.RGB)
    views = {}
    for output in _MULTICROP_OUTPUTS:
        kind = output.name.split("_")[0]
        size = int(p[f"{kind}_size"])
        view = fn.random_resized_crop(
            images,
            device=ctx.device,
            size=[size, size],
            random_area=[p[f"{kind}_area_min"], p[f"{kind}_area_max"]],
            random_aspect_ratio=[3 / 4, 4 / 3],
            antialias=True,
            **ctx.rng(),
        )
        view = _jitter(view, ctx, p)
        mirror = fn.random.coin_flip(probability=p["flip"], **ctx.rng())
        views[output.name] = ctx.finish(view, mirror=mirror)
    return views


_DETECTION_OUTPUTS = (
    Output(name="images"),
    Output(name="boxes", kind="ragged"),
    Output(name="labels", kind="ragged"),
)
_DETECTION_INPUTS = (Input(name="boxes", kind="float"), Input(name="labels", kind="int"))
# SSD's crop: the smallest IoU with a box that a window must reach, drawn per sample.
_SSD_THRESHOLDS = [0.0, 0.1, 0.3, 0.5, 0.7, 0.9]


def _detection(
    encoded: Any, labels: Any, ctx: BuildContext, p: Mapping[str, float], fields: Any
) -> dict[str, Any]:
    """SSD's augmentation: a random crop that keeps boxes (each window overlaps a box by at
    least an IoU drawn from SSD's thresholds, or no crop), decoded only there, resized to
    ``size`` square, and flipped, image and boxes together. Boxes come out as ``[left, top,
    right, bottom]`` pixels of the output image, with their classes."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    shape = fn.peek_image_shape(encoded, dtype=types.FLOAT)  # height, width, channels
    width, height = shape[1], shape[0]
    relative = fields["boxes"] / fn.stack(width, height, width, height)
    anchor, window, relative, classes = fn.random_bbox_crop(
        relative,
        fn.cast(fields["labels"], dtype=types.INT32),
        bbox_layout="xyXY",
        aspect_ratio=[p["aspect_min"], p["aspect_max"]],
        scaling=[p["scale_min"], 1.0],
        thresholds=_SSD_THRESHOLDS,
        allow_no_crop=True,
        num_attempts=50,
        **ctx.rng(),
    )
    images = fn.decoders.image_slice(
        encoded, anchor, window, **ctx.decoder_args(), output_type=types.RGB
    )
    size = int(p["size"])
    images = fn.resize(images, device=ctx.device, resize_x=size, resize_y=size, antialias=True)
    flip = fn.random.coin_flip(probability=p["flip"], **ctx.rng())
    relative = fn.bb_flip(relative, ltrb=True, horizontal=flip)
    return {
        "images": ctx.finish(images, mirror=flip),
        "boxes": relative * float(size),
        "labels": fn.cast(classes, dtype=types.INT64),
    }


def _segmentation(
    encoded: Any, labels: Any, ctx: BuildContext, p: Mapping[str, float], fields: Any
) -> dict[str, Any]:
    """A random-resized crop of the image and its mask with one window, resized to
    ``size`` square (the image smoothly, the mask to its nearest pixel, so that it keeps
    its classes), and flipped together."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    anchor, window = fn.random_crop_generator(
        fn.peek_image_shape(encoded),
        random_area=[p["area_min"], p["area_max"]],
        random_aspect_ratio=[p["aspect_min"], p["aspect_max"]],
        **ctx.rng(),
    )
    images = fn.decoders.image(encoded, **ctx.decoder_args(), output_type=types.RGB)
    masks = fn.decoders.image(fields["mask"], device="cpu", output_type=types.GRAY)
    images = fn.slice(images, anchor, window, axis_names="HW")
    masks = fn.slice(masks, anchor, window, axis_names="HW")
    size = int(p["size"])
    images = fn.resize(images, device=ctx.device, resize_x=size, resize_y=size, antialias=True)
    masks = fn.resize(
        masks, resize_x=size, resize_y=size, interp_type=types.INTERP_NN, antialias=False
    )
    flip = fn.random.coin_flip(probability=p["flip"], **ctx.rng())
    masks = fn.flip(masks, horizontal=flip)
    return {"images": ctx.finish(images, mirror=flip), "mask": fn.squeeze(masks, axes=[2])}


def _captions(
    encoded: Any, labels: Any, ctx: BuildContext, p: Mapping[str, float], fields: Any
) -> dict[str, Any]:
    """val's image (resize the shorter side, centre crop) beside each sample's caption(s),
    as they were ingested."""
    images, _ = _val(encoded, labels, ctx, p)
    return {"images": images, "caption": fields["caption"]}


def _ordered(name: str, *ranges: str) -> Callable[[Mapping[str, float]], None]:
    """The check of pipeline ``name``'s ``ranges``: each ``R_min`` at most ``R_max``."""

    def check(p: Mapping[str, float]) -> None:
        for r in ranges:
            if p[f"{r}_min"] > p[f"{r}_max"]:
                raise ParamError(f"{name}: {r}_min must not exceed {r}_max")

    return check


def _check_val(p: Mapping[str, float]) -> None:
    if p["size"] > p["resize"]:
        raise ParamError("val: the crop size must not exceed the resize of the shorter side")


_SIZE = Param(default=224, low=8, high=1024, integer=True, help="output height and width")
_RESIZE = Param(default=256, low=8, high=4096, integer=True, help="shorter side")
_FLIP = Param(default=0.5, low=0.0, high=1.0, help="horizontal flip probability")

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
            "flip": _FLIP,
        },
        check=_ordered("train", "area", "aspect"),
    ),
    "val": PipelineSpec(
        name="val",
        function=_val,
        description="decode, resize shorter side to resize, centre crop size, normalize",
        params={
            "size": _SIZE,
            "resize": _RESIZE,
        },
        check=_check_val,
    ),
    "detection": PipelineSpec(
        name="detection",
        function=_detection,
        description=(
            "SSD's augmentation for detection: a random crop that keeps boxes, resize to size, "
            "flip, image and boxes together; the client gets torchvision's targets"
        ),
        params={
            "size": Param(default=320, low=8, high=2048, integer=True, help="output side"),
            "scale_min": Param(default=0.3, low=0.01, high=1.0, help="smallest crop side"),
            "aspect_min": Param(default=0.5, low=0.1, high=10.0, help="smallest crop aspect"),
            "aspect_max": Param(default=2.0, low=0.1, high=10.0, help="largest crop aspect"),
            "flip": _FLIP,
        },
        check=_ordered("detection", "aspect"),
        outputs=_DETECTION_OUTPUTS,
        form="detection",
        inputs=_DETECTION_INPUTS,
    ),
    "segmentation": PipelineSpec(
        name="segmentation",
        function=_segmentation,
        description=(
            "a random-resized crop, resize to size and flip of each image and its mask "
            "together; the client gets the masks as class maps"
        ),
        params={
            "size": Param(default=512, low=8, high=2048, integer=True, help="output side"),
            "area_min": Param(default=0.25, low=0.01, high=1.0, help="smallest crop area"),
            "area_max": Param(default=1.0, low=0.01, high=1.0, help="largest crop area"),
            "aspect_min": Param(default=3 / 4, low=0.1, high=10.0, help="smallest aspect"),
            "aspect_max": Param(default=4 / 3, low=0.1, high=10.0, help="largest aspect"),
            "flip": _FLIP,
        },
        check=_ordered("segmentation", "area", "aspect"),
        outputs=(Output(name="images"), Output(name="mask", kind="tensor")),
        form="segmentation",
        inputs=(Input(name="mask", kind="image"),),
    ),
    "captions": PipelineSpec(
        name="captions",
        function=_captions,
        description="val's image beside each sample's caption(s), for image-text training",
        params={
            "size": _SIZE,
            "resize": _RESIZE,
        },
        check=_check_val,
        outputs=(Output(name="images"), Output(name="caption", kind="text")),
        form="captions",
        inputs=(Input(name="caption", kind="text"),),
    ),
    "multicrop": PipelineSpec(
        name="multicrop",
        function=_multicrop,
        description=(
            "self-supervised views (DINO's): 2 global crops and 8 local ones of each image, "
            "each with its own random-resized crop, colour jitter, grayscale and flip"
        ),
        params={
            "global_size": Param(
                default=224, low=8, high=1024, integer=True, help="global views' side"
            ),
            "local_size": Param(
                default=96, low=8, high=1024, integer=True, help="local views' side"
            ),
            "global_area_min": Param(
                default=0.4, low=0.01, high=1.0, help="global crops' smallest area"
            ),
            "global_area_max": Param(
                default=1.0, low=0.01, high=1.0, help="global crops' largest area"
            ),
            "local_area_min": Param(
                default=0.05, low=0.01, high=1.0, help="local crops' smallest area"
            ),
            "local_area_max": Param(
                default=0.4, low=0.01, high=1.0, help="local crops' largest area"
            ),
            "flip": _FLIP,
            "jitter": Param(default=0.8, low=0.0, high=1.0, help="colour jitter probability"),
            "brightness": Param(default=0.4, low=0.0, high=1.0, help="brightness jitter"),
            "contrast": Param(default=0.4, low=0.0, high=1.0, help="contrast jitter"),
            "saturation": Param(default=0.2, low=0.0, high=1.0, help="saturation jitter"),
            "hue": Param(default=0.1, low=0.0, high=0.5, help="hue jitter (of the circle)"),
            "grayscale": Param(default=0.2, low=0.0, high=1.0, help="grayscale probability"),
        },
        check=_ordered("multicrop", "global_area", "local_area"),
        outputs=_MULTICROP_OUTPUTS,
        form="views",
    ),
}
