"""A custom batchwire pipeline: grayscale, resize, centre crop, brightness/contrast jitter, flip.

Named in the server config (see ``custom.toml`` beside this file)::

    [pipelines.gray]
    function = "custom_pipeline.py:grayscale_jitter"   # or "my_package.my_module:function"

The server calls the function once per pipeline it builds (per batch size,
device, output dtype/layout and parameter values), with:

- ``encoded``: a DALI node, a batch of encoded image files (1-D uint8 arrays
  on the CPU: JPEG, PNG, ...), already screened by the server;
- ``labels``: a DALI node, the batch's int64 labels (one scalar per sample);
- ``ctx``: a ``BuildContext``. ``ctx.device`` is ``"cpu"`` or ``"gpu"`` and
  ``ctx.decoder_args()`` the decoder's device (``"cpu"`` or ``"mixed"``) with,
  on the GPU, the buffer sizes the server is configured with: pass them to the
  ops so the pipeline runs where the server runs it. ``ctx.finish(images, crop=...,
  mirror=...)`` must make the output: it casts and lays out as the client
  asked (uint8 NCHW by default; float16/float32 normalized with the mean/std
  of the config; NHWC);
- ``params``: the resolved parameters, ``{name: float}``: the defaults of the
  config, overridden by what the client sent, each already checked against
  its declared ``[low, high]`` (and made whole when ``integer = true``).

It returns ``(images, labels)``. Every image of a batch must come out with the
same shape (crop to a fixed size), because batches travel as one tensor. The
function runs inside the server process, with its rights: only the server's
operator names it; clients only choose the pipeline by name and send numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import nvidia.dali.fn as fn
import nvidia.dali.types as types


def grayscale_jitter(
    encoded: Any, labels: Any, ctx: Any, params: Mapping[str, float]
) -> tuple[Any, Any]:
    """Grayscale in three equal channels (for models that expect RGB), then augment."""
    images = fn.decoders.image(encoded, **ctx.decoder_args(), output_type=types.GRAY)
    images = fn.cat(images, images, images, axis=2)
    size = int(params["size"])
    # A crop larger than the image would read outside it: resize at least to the crop.
    images = fn.resize(
        images, device=ctx.device, resize_shorter=max(params["resize"], size), antialias=True
    )
    jitter = params["jitter"]
    if jitter > 0:  # parameters are plain numbers when the graph is built
        images = fn.brightness_contrast(
            images,
            device=ctx.device,
            # ctx.rng(): the draws a function of the batch, the same each time it is served
            brightness=fn.random.uniform(range=[1.0 - jitter, 1.0 + jitter], **ctx.rng()),
            contrast=fn.random.uniform(range=[1.0 - jitter, 1.0 + jitter], **ctx.rng()),
        )
    mirror = fn.random.coin_flip(probability=params["flip"], **ctx.rng())
    return ctx.finish(images, crop=(size, size), mirror=mirror), labels
