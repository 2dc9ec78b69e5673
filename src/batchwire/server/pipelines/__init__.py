"""Named pipelines: what a server can run for a stream, by name.

A pipeline is a function that turns a batch of encoded images and labels (DALI nodes fed
by ``fn.external_source``) into ``(images, labels)``, with the parameters a request may
override within declared ranges. Clients never send code: they choose a pipeline by name.
The presets are ``train`` and ``val``; a server config adds custom ones
(:func:`load_function`). Importing this package loads neither DALI nor LMDB.
"""

from __future__ import annotations

from batchwire.server.pipelines._presets import PRESETS
from batchwire.server.pipelines._spec import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BuildContext,
    Draws,
    Input,
    Output,
    OutputSpec,
    Param,
    ParamError,
    PipelineFn,
    PipelineSpec,
    load_function,
)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PRESETS",
    "BuildContext",
    "Draws",
    "Input",
    "Output",
    "OutputSpec",
    "Param",
    "ParamError",
    "PipelineFn",
    "PipelineSpec",
    "load_function",
]
