"""The reference model of ``bagualu2 selftest`` and one step of it: the bench both its rows
(bagualu2/cli/selftest.py) and its device rows (bagualu2/cli/selftest_device.py) run, and the
bitwise comparison of two steps' loss and gradients."""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, List, Optional, Tuple

import torch

__all__ = ["Bench", "same"]


class Bench:
    """The reference model and its batches, on the device under test."""

    def __init__(self, device: torch.device, gpu: bool, seed: int, batch: Tuple[int, int]) -> None:
        from bagualu2.models import MoEConfig, MoETransformer

        self.device = device
        torch.manual_seed(seed)
        cfg = MoEConfig.small(dropout=0.1) if gpu else MoEConfig.tiny(dropout=0.1)
        self.model = MoETransformer(cfg).to(device)
        self.batch = batch
        self.seed = seed

    def tokens(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.seed + i)
        return torch.randint(0, self.model.cfg.vocab_size, self.batch, generator=g).to(self.device)

    def fresh(self) -> torch.nn.Module:
        return copy.deepcopy(self.model)

    def step(self, model: torch.nn.Module, i: int, spike: float, dtype: str = "fp32",
             after_forward: Optional[Callable[[], None]] = None) -> Tuple[torch.Tensor, List]:
        """Forward and backward of micro-batch i: the loss and every gradient (on the cpu)."""
        model.zero_grad(set_to_none=True)
        torch.manual_seed(i)  # dropout: same masks for every run of micro-batch i
        cast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if dtype == "bf16"
                else contextlib.nullcontext())
        spiked = model.routing_spike(spike, experts=(0,)) if spike else contextlib.nullcontext()
        with spiked:
            with cast:
                loss = model(self.tokens(i))
            if after_forward is not None:
                after_forward()
            loss.float().backward()
        return loss.detach().cpu(), [None if p.grad is None else p.grad.detach().cpu()
                                     for p in model.parameters()]


def same(a: Tuple[torch.Tensor, List], b: Tuple[torch.Tensor, List]) -> bool:
    return torch.equal(a[0], b[0]) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a[1], b[1]))
