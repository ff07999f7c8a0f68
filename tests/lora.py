"""A LoRA-style model in plain torch for the fine-tuning tests and benchmark: a frozen
base of linear layers, each with a trainable low-rank adapter (``x A^T B^T``)."""

from __future__ import annotations

import torch
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d) * 0.01)
        self.b = nn.Parameter(torch.zeros(d, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def build(d: int = 256, layers: int = 3, rank: int = 16, seed: int = 0):
    """The model and an AdamW over its trainable parameters only."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[m for _ in range(layers) for m in (LoRALinear(d, rank), nn.ReLU())])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, d: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, d, generator=g), torch.randn(8, d, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def trainable_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The trainable state: the parameters that require grad and the optimizer's state."""
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(v.numel() * v.element_size() for s in opt.state.values()
                for v in s.values() if torch.is_tensor(v))
    return params + state


def base_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
