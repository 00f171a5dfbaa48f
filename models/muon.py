"""Muon (momentum orthogonalised by Newton-Schulz; Jordan et al. 2024) in float32.

torch.optim.Muon runs its Newton-Schulz iteration in bfloat16, which an AVX2-only CPU
emulates: there a step of the 6.3M-parameter target took ~14 s instead of ~1.5 s. This is
the same update (EMA momentum, Nesterov, the quintic iteration with torch's coefficients,
torch's "original" learning-rate scaling, decoupled weight decay) in float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz, as torch.optim.Muon
NS_STEPS = 5


def orthogonalise(update: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T of update = U S V^T ([rows, cols] in, same shape out; singular
    values land near 1, not exactly on it, which is all Muon needs)."""
    a, b, c = NS_COEFFICIENTS
    x = update.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T  # iterate on the smaller Gram matrix
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """For 2-D weight matrices only; embeddings, norms and biases belong with AdamW."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            lr, mu, decay = group["lr"], group["momentum"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.dim() != 2:
                    raise ValueError(f"Muon takes 2-D weights only, got shape {tuple(param.shape)}")
                state = self.state[param]
                buf = state.setdefault("momentum", torch.zeros_like(param))
                buf.lerp_(param.grad, 1 - mu)
                update = orthogonalise(param.grad.lerp(buf, mu))  # Nesterov
                rows, cols = param.shape
                param.mul_(1 - lr * decay)
                param.add_(update, alpha=-lr * math.sqrt(max(1.0, rows / cols)))
