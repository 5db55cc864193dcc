"""Straight-through fake quantization: the quantized value forward, the identity gradient back."""

from __future__ import annotations

import torch

__all__ = ["straight_through"]


class _StraightThrough(torch.autograd.Function):
    """Forward returns a precomputed value; backward passes the gradient to x unchanged."""

    @staticmethod
    def forward(ctx, x, value):  # noqa: D401 - autograd signature
        return value

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` on x's device and in x's dtype in the forward pass, identity gradient to ``x``.

    Without a gradient to carry (grad mode off, or ``x`` not requiring one) no autograd node is made.
    """
    value = value.to(device=x.device, dtype=x.dtype)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return value
    return _StraightThrough.apply(x, value)
