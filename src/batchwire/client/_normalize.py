"""Per-channel normalization with the mean/std a server announces (0..255 pixel scale)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["channel_stats"]


def channel_stats(
    mean: Sequence[float], std: Sequence[float], layout: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``mean`` and ``std`` on ``device``, shaped to broadcast over a batch in
    ``layout`` (NCHW or NHWC): ``(images.float() - mean) / std`` normalizes it."""
    shape = (1, -1, 1, 1) if layout == "NCHW" else (1, 1, 1, -1)
    m = torch.tensor(list(mean) or [0.0], dtype=torch.float32).reshape(shape)
    s = torch.tensor(list(std) or [1.0], dtype=torch.float32).reshape(shape)
    return m.to(device), s.to(device)
