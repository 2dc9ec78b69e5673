"""``--dataset`` of the commands that stream (preview, bench): one dataset's name, or a
mixture of several as ``NAME=WEIGHT,NAME=WEIGHT``; and what bench says of a dataset that
yields no batch of ``--batch-size``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchwire.client import Mixture

__all__ = ["DATASET_HELP", "batched", "dataset_or_mixture", "no_batch_error"]

DATASET_HELP = (
    "dataset name on the server, or a mixture of several in set proportions: "
    "NAME=WEIGHT,NAME=WEIGHT (e.g. pets=0.7,curated=0.3; an epoch of their sizes added up)"
)


def dataset_or_mixture(text: str) -> str | Mixture:
    """``text`` as RemoteLoader's ``dataset``: a name, or a :class:`Mixture` of weights
    (argparse's ``type``: ``ArgumentTypeError`` says what is wrong)."""
    if "=" not in text and "," not in text:
        return text
    from batchwire.client import InvalidArgumentError, Mixture

    weights: dict[str, float] = {}
    for part in text.split(","):
        name, equals, weight = part.strip().partition("=")
        if not equals or name in weights:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} in {text!r}: a mixture is NAME=WEIGHT,NAME=WEIGHT, each "
                "dataset once"
            )
        try:
            weights[name] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} in {text!r}: the weight must be a number"
            ) from None
    try:
        return Mixture(weights)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc.details}") from None


def batched(dataset: str | Mixture, batching: str) -> str | Mixture:
    """``dataset`` with a mixture's datasets sharing batches as ``batching`` says
    (``ArgumentTypeError`` for one dataset batched per source: it has one source)."""
    if isinstance(dataset, str):
        if batching != "random":
            raise argparse.ArgumentTypeError(
                f"--batching {batching} is for a mixture: give --dataset NAME=WEIGHT,NAME=WEIGHT"
            )
        return dataset
    from batchwire.client import Mixture

    return Mixture(dict(dataset.weights or {}), length=dataset.length, batching=batching)


def no_batch_error(dataset: str, samples: int, batch_size: int) -> str:
    return (
        f"error: an epoch of {dataset!r} yielded no batch: --batch-size {batch_size} is larger "
        f"than the dataset ({samples} samples), or than this client's share of it (the last "
        f"partial batch is dropped); lower --batch-size"
    )
