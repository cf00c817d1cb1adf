"""The testbed PRM's head: an L2-regularised logistic regression, fitted deterministically.

``sart.testbed.train`` fits it on the PRM's features at every step separator of the
policy's own graded rollouts; ``benchmarks/testbed_prm_ablation.py`` fits it on
other feature sets. Needs the ``[hf]`` extra (torch).
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class Logistic:
    """A fitted L2-regularised logistic regression on standardised features."""

    mean: torch.Tensor
    scale: torch.Tensor
    weight: torch.Tensor
    bias: float
    loss: float
    """The final training loss (penalty included)."""

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return ((features - self.mean) / self.scale) @ self.weight + self.bias


def fit_logistic(features: torch.Tensor, labels: torch.Tensor, l2: float) -> Logistic:
    """Standardise ``features`` and fit a logistic regression of ``labels``
    (full batch, L-BFGS: deterministic)."""
    mean, scale = features.mean(0), features.std(0).clamp_min(1e-6)
    x = (features - mean) / scale
    weight = torch.zeros(x.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=500, line_search_fn="strong_wolfe")

    def loss_fn() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ weight + bias, labels)
        loss = loss + l2 * (weight**2).sum()
        loss.backward()
        return loss

    optimizer.step(loss_fn)
    final = float(loss_fn().detach())
    return Logistic(mean, scale, weight.detach(), float(bias.detach()[0]), final)
