"""A LoRA-style model for the base-model tests, in plain torch: a frozen base of
linear layers with a small trainable low-rank adapter on each, and a trainable head.
``build`` and ``inputs`` are what ``snapd diff --outputs --model lora_head:build --inputs
lora_head:inputs`` imports (tests/ is on sys.path)."""

from __future__ import annotations

import torch


class LoraLinear(torch.nn.Module):
    def __init__(self, n: int, rank: int = 2) -> None:
        super().__init__()
        self.base = torch.nn.Linear(n, n)
        self.base.requires_grad_(False)
        self.down = torch.nn.Linear(n, rank, bias=False)
        self.up = torch.nn.Linear(rank, n, bias=False)
        torch.nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Lora(torch.nn.Module):
    def __init__(self, n: int = 16, layers: int = 2, out: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[LoraLinear(n) for _ in range(layers)])
        self.head = torch.nn.Linear(n, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.blocks(x)))


def build() -> Lora:
    """The model with its base weights: the same every call (a fixed seed)."""
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        return Lora()


def inputs() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(7))


def trainable_keys(model: torch.nn.Module) -> set:
    """The state-dict keys training changes (the adapters and the head)."""
    grads = {id(p) for p in model.parameters() if p.requires_grad}
    return {k for k, v in model.state_dict(keep_vars=True).items() if id(v) in grads}


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    x = inputs()
    for _ in range(n):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
