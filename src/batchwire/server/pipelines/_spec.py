"""What a named pipeline is: its graph function, tunable parameters and output, and how a
custom one is loaded from a server config.

A pipeline definition is a function that turns a batch of encoded images and
labels (DALI nodes fed by ``fn.external_source``) into ``(images, labels)``, or, for a
pipeline that declares named outputs (:class:`Output`: several views of each image, boxes
per image), into a mapping of those names to DALI nodes; the batch's labels are then the
samples' own. It receives a :class:`BuildContext` that says where ops run and how the
output travels (dtype, layout, normalization), and the resolved parameters.

Clients never send code: they choose a pipeline by name and may override only
the parameters its :class:`PipelineSpec` declares, within declared ranges.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import pathlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

from batchwire.common.params import ParamRange, check_params
from batchwire.common.stream import LAYOUTS as WIRE_LAYOUTS
from batchwire.common.stream import OUTPUT_DTYPES
from batchwire.server.errors import ParamError

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
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

# ImageNet statistics (torchvision's mean and std) in the 0..255 pixel scale.
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)

# The output formats a stream or a Preprocess request may ask for (batchwire.common.stream).
DTYPES = tuple(OUTPUT_DTYPES)
LAYOUTS = tuple(WIRE_LAYOUTS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Param(ParamRange):
    """A tunable parameter: its default and the closed range a request may set (checked
    with the client's wording, batchwire.common.params)."""

    default: float
    help: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputSpec:
    """How images travel: dtype, layout, and the normalization that applies.

    ``uint8`` output is not normalized (the client applies ``mean``/``std``);
    ``float16``/``float32`` output is normalized on the server.
    """

    dtype: str = "uint8"
    layout: str = "NCHW"
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ParamError(f"output dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ParamError(f"output layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def normalized(self) -> bool:
        return self.dtype != "uint8"


class Draws:
    """The random states of a pipeline's random operators, fed with each batch: one per
    operator (:meth:`BuildContext.rng` hands them out as the graph is defined), drawn from
    the batch's entropy as the runner feeds it (``runners._dali``). DALI seeds a random operator's batch from one
    state (its first sample's) and each sample from it and the sample's place, so a batch
    of the same samples in the same order is augmented the same wherever and whenever it
    runs: on any server, after a failover or a resume, over any transport."""

    # The uint32 words of one of DALI's random states (its Philox state, 25 bytes).
    WORDS = 7

    def __init__(self) -> None:
        self._states: Any = None  # a DALI node: ``(count, WORDS)`` uint32 a sample
        self.count = 0

    def feed(self, states: Any) -> None:
        """Take the operators' states from ``states``, the graph's input node of them."""
        self._states = states

    def next(self) -> Any:
        """The state node of one more random operator."""
        self.count += 1
        return self._states[self.count - 1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildContext:
    """Where a pipeline's ops run and what it must emit.

    ``device`` is ``"cpu"`` or ``"gpu"``; on ``"gpu"`` the decoder runs as
    ``"mixed"`` (nvJPEG) and the other ops on the GPU.
    """

    device: str
    output: OutputSpec
    # The mixed decoder's per-thread buffers, in bytes (DALI's defaults unless configured).
    host_padding: int = 8 << 20
    device_padding: int = 16 << 20
    # The share of JPEGs for the GPU's hardware decoders, where it has them (DALI's 0.65
    # unless configured).
    hw_decoder_load: float = 0.65
    # Where the graph's random operators take their states from: each batch's own (set
    # while the server defines the graph, where DALI can take them). None: each operator
    # draws from a seed of its own, as in DALI's own pipelines.
    draws: Draws | None = None

    def rng(self) -> dict[str, Any]:
        """Keyword arguments that make a DALI random operator's draws a function of the
        batch (its samples' ids, the stream's seed and epoch): pass them to every random
        operator of a pipeline, ``fn.random.coin_flip(probability=0.5, **ctx.rng())``, and
        a batch is augmented the same each time it is served. Empty where the server
        cannot feed states (DALI before random states were operators' inputs)."""
        if self.draws is None:
            return {}
        return {"_random_state": self.draws.next()}

    def decoder_args(self) -> dict[str, Any]:
        """Keyword arguments for a DALI image decoder: its device, and on the GPU the
        sizes of the buffers it keeps per thread (``host_memory_padding``: two pinned host
        buffers; ``device_memory_padding``: one device buffer) and the hardware decoders'
        share (``hw_decoder_load``)."""
        if self.device != "gpu":
            return {"device": "cpu"}
        return {
            "device": "mixed",
            "host_memory_padding": self.host_padding,
            "device_memory_padding": self.device_padding,
            "hw_decoder_load": self.hw_decoder_load,
        }

    def finish(
        self, images: Any, *, crop: tuple[int, int] | None = None, mirror: Any = None
    ) -> Any:
        """Crop (centre), mirror, cast and lay out ``images`` as the output spec says."""
        import nvidia.dali.fn as fn
        import nvidia.dali.types as types

        out = self.output
        kwargs: dict[str, Any] = {
            "device": self.device,
            "output_layout": "CHW" if out.layout == "NCHW" else "HWC",
        }
        if out.normalized:
            kwargs.update(
                dtype=types.FLOAT16 if out.dtype == "float16" else types.FLOAT,
                mean=list(out.mean),
                std=list(out.std),
            )
        else:
            kwargs.update(dtype=types.UINT8)
        if crop is not None:
            kwargs["crop"] = crop
        if mirror is not None:
            kwargs["mirror"] = mirror
        return fn.crop_mirror_normalize(images, **kwargs)


PipelineFn = Callable[..., Any]

# How a client hands the batches of a pipeline with named outputs to the loop: its image
# outputs as a list (the views of self-supervised training) and the labels; the images and
# a target a sample as torchvision's detection models take them (outputs images, boxes,
# labels); the images and their masks (outputs images, mask); the images and their captions
# (outputs images, caption); or a dict of every output by name and the labels.
FORMS = ("views", "detection", "segmentation", "captions", "named")
# The outputs each form arranges, by name and kind (the views form: image outputs alone).
FORM_OUTPUTS = {
    "detection": {"images": "image", "boxes": "ragged", "labels": "ragged"},
    "segmentation": {"images": "image", "mask": "tensor"},
    "captions": {"images": "image", "caption": "text"},
}
# A dataset field's kind (the manifest's schema) as a pipeline receives it: a DALI node of
# these arrays, one a sample (text, bytes and encoded images as their bytes).
INPUT_KINDS = ("int", "float", "text", "bytes", "image")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Input:
    """A dataset field a pipeline needs (``kind`` as the dataset's schema declares it): a
    stream of a dataset without it is refused, naming both, and a sample whose value is
    missing or malformed is skipped as a corrupt image is."""

    name: str
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in INPUT_KINDS:
            raise ParamError(f"input {self.name!r}: kind must be one of {INPUT_KINDS}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Output:
    """One named output of a pipeline: ``kind`` "image" (pixels, as the stream asks for
    them: see :meth:`BuildContext.finish`; normalized by the client like a one-output
    pipeline's images), "tensor" (one shape for every sample) or "ragged" (a first
    dimension that varies from sample to sample: a box list per image)."""

    name: str
    kind: str = "image"
    layout: str = ""

    def __post_init__(self) -> None:
        from batchwire.common.outputs import KINDS

        if not self.name.isidentifier():
            raise ParamError(f"an output's name must be an identifier, got {self.name!r}")
        if self.kind not in KINDS:
            raise ParamError(
                f"output {self.name!r}: kind must be one of {KINDS}, not {self.kind!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """What to build for a named pipeline: its graph function, tunable parameters and
    statistics. Built for a :class:`~batchwire.server.runners._keys.RunnerKey`, it becomes a
    :class:`~batchwire.server.runners._runner.Runner`."""

    name: str
    function: PipelineFn
    params: Mapping[str, Param]
    description: str = ""
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    check: Callable[[Mapping[str, float]], None] | None = None
    # Named outputs (none: the function returns ``(images, labels)``), and how a client
    # hands them to the loop (FORMS).
    outputs: tuple[Output, ...] = ()
    form: str = "named"
    # Dataset fields the function receives, as a fifth argument: a dict of DALI nodes.
    inputs: tuple[Input, ...] = ()

    def __post_init__(self) -> None:
        names = [output.name for output in self.outputs]
        if len(set(names)) != len(names):
            raise ParamError(f"pipeline {self.name!r}: output names repeat: {names}")
        if self.form not in FORMS:
            raise ParamError(
                f"pipeline {self.name!r}: form must be one of {FORMS}, not {self.form!r}"
            )
        if self.form == "views" and any(o.kind != "image" for o in self.outputs):
            raise ParamError(f"pipeline {self.name!r}: the views form takes image outputs only")
        wanted = FORM_OUTPUTS.get(self.form)
        if self.outputs and wanted and {o.name: o.kind for o in self.outputs} != wanted:
            raise ParamError(f"pipeline {self.name!r}: the {self.form} form takes outputs {wanted}")

    def resolve(self, overrides: Mapping[str, float] | None = None) -> dict[str, float]:
        """Defaults updated by ``overrides``; unknown names or bad values raise ParamError."""
        values = {name: param.default for name, param in self.params.items()}
        try:
            values.update(check_params(self.name, overrides or {}, self.params))
        except ValueError as exc:
            raise ParamError(str(exc)) from None
        if self.check is not None:
            self.check(values)
        return values

    def with_defaults(self, defaults: Mapping[str, float]) -> PipelineSpec:
        """The same pipeline with other defaults (from server config), checked."""
        self.resolve(defaults)
        params = dict(self.params)
        for name, value in defaults.items():
            params[name] = dataclasses.replace(params[name], default=float(value))
        return dataclasses.replace(self, params=params)


def load_function(reference: str, base_dir: pathlib.Path | None = None) -> PipelineFn:
    """Import ``module:function`` named in the server config (never by a client).

    The module part may also be a Python file, ``path/to/file.py:function``,
    relative to ``base_dir`` (the config file's directory) unless absolute.
    """
    module_name, _, attr = reference.rpartition(":")
    if not module_name or not attr:
        raise ParamError(
            f"a custom pipeline must be named as 'module:function' or 'file.py:function', "
            f"got {reference!r}"
        )
    if module_name.endswith(".py"):
        module = _load_file(pathlib.Path(module_name), base_dir)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ParamError(f"cannot import pipeline module {module_name!r}: {exc}") from exc
    function = getattr(module, attr, None)
    if not callable(function):
        raise ParamError(f"{reference!r}: module {module_name!r} has no function {attr!r}")
    return function  # type: ignore[no-any-return]


def _load_file(path: pathlib.Path, base_dir: pathlib.Path | None) -> types.ModuleType:
    if not path.is_absolute():
        path = (base_dir or pathlib.Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        raise ParamError(
            f"pipeline file {path} does not exist (a relative path starts at the config file)"
        )
    # One module per file, whichever config names it; registered so that the
    # file's own imports and dataclasses work.
    name = f"batchwire_pipelines_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}_{path.stem}"
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ParamError(f"cannot load pipeline file {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ParamError(f"pipeline file {path} failed to import: {exc!r}") from exc
    return module
