"""Deterministic synthetic token data for the reference model."""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import Tensor


def synthetic_batches(vocab_size: int, batch_size: int, seq_len: int, seed: int = 0,
                      num_batches: Optional[int] = None, branching: int = 4) -> Iterator[Tensor]:
    """Yield int64 [batch_size, seq_len] token batches, identical for identical arguments.

    Sequences are walks on a fixed random graph (drawn from ``seed``) where every token has
    ``branching`` possible successors, so a model can learn them: the next-token loss falls
    from ``log(vocab_size)`` towards ``log(branching)``. Endless when ``num_batches`` is None.
    """
    for name, value in (("vocab_size", vocab_size), ("batch_size", batch_size),
                        ("seq_len", seq_len), ("branching", branching)):
        if value < 1:
            raise ValueError(f"synthetic_batches needs {name} >= 1, got {value}")
    if num_batches is not None and num_batches < 0:
        raise ValueError(f"synthetic_batches needs num_batches >= 0 or None, got {num_batches}")
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab_size, (vocab_size, branching), generator=gen)
    produced = 0
    while num_batches is None or produced < num_batches:
        batch = torch.empty(batch_size, seq_len, dtype=torch.long)
        batch[:, 0] = torch.randint(vocab_size, (batch_size,), generator=gen)
        choices = torch.randint(branching, (batch_size, seq_len), generator=gen)
        for t in range(1, seq_len):
            batch[:, t] = successors[batch[:, t - 1], choices[:, t]]
        yield batch
        produced += 1
