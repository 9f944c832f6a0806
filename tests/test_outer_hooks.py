"""Other saved-tensor hooks and a provisioned forward: only the innermost pair of hooks
applies, so a forward run inside someone else's (``save_on_cpu``, a framework's activation
offloading) is refused at its start, naming their pack hook and the fix; hooks a block enters
inside the forward stay exact."""
from __future__ import annotations

import copy
from typing import Any, List, Tuple

import pytest
import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer


def tiny() -> Tuple[MoETransformer, torch.Tensor]:
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny())
    return model, torch.randint(0, model.cfg.vocab_size, (2, 16))


def loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _my_pack(t: torch.Tensor) -> Any:
    return t


def _my_unpack(t: Any) -> torch.Tensor:
    return t


@pytest.mark.parametrize("outer", ["save_on_cpu", "custom"])
def test_a_forward_inside_other_saved_tensor_hooks_is_refused_naming_them(outer: str) -> None:
    model, tokens = tiny()
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=1 << 20)
    hooks = (torch.autograd.graph.save_on_cpu() if outer == "save_on_cpu"
             else torch.autograd.graph.saved_tensors_hooks(_my_pack, _my_unpack))
    name = "save_on_cpu" if outer == "save_on_cpu" else "test_outer_hooks._my_pack"
    with hooks, pytest.raises(RuntimeError, match=f"inside other saved-tensor hooks \\(pack hook [^)]*{name}"):
        model(tokens)
    # Nothing was left behind: the next forward, outside them, is provisioned and exact.
    a = loss_and_grads(model, tokens)
    b = loss_and_grads(plain, tokens)
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert prov.report()["micro_batches"] == 1
    prov.disable()


def test_hooks_a_block_enters_inside_the_forward_stay_exact() -> None:
    """``save_on_cpu`` inside each layer's forward: innermost there, it takes those saves, and
    bagualu2 the rest."""
    model, tokens = tiny()
    plain = copy.deepcopy(model)
    for m in (model, plain):
        for layer in m.layers:
            own = layer.forward

            def offloaded(*args: Any, _own: Any = own, **kwargs: Any) -> Any:
                with torch.autograd.graph.save_on_cpu():
                    return _own(*args, **kwargs)

            layer.forward = offloaded
    reference = loss_and_grads(plain, tokens)
    prov = bagualu2.enable(model, budget=1 << 20)
    for _ in range(3):
        a = loss_and_grads(model, tokens)
        assert torch.equal(a[0], reference[0]) and all(torch.equal(x, y) for x, y in zip(a[1], reference[1]))
    prov.disable()
