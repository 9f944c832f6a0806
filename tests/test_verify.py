"""The run-time exactness check (``enable(verify=...)``, bagualu2/runtime/verify.py): what a
forward released comes back to backward as it was saved, or ``ExactnessError`` says which
operator, micro-batch and way of release, and the first element that differs."""
from __future__ import annotations

import copy
import gc
from typing import Any, List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bagualu2
from bagualu2.runtime.verify import SAMPLE_EVERY, fingerprint
from bagualu2.shared import Choice

W = 16


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(W, W) / W ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) * x


class Net(torch.nn.Module):
    """Block 0 leaves ``stash`` (a storage nothing else holds) for block 2, which saves it;
    ``data_write`` makes block 1 write it through ``.data`` (no version counter moves);
    ``scale``, read by block 2, is Python-side state a training loop may change."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.numpy_write = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.sin(x)
        x = self.blocks[0](x)
        stash = x * 1.0
        x = self.blocks[1](x)
        if self.numpy_write:
            array = stash.detach().numpy()
            array *= 3
        x = self.blocks[2](x * stash)
        return x.square().mean()


def step(model: torch.nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def same(a: Tuple[torch.Tensor, List[torch.Tensor]], b: Tuple[torch.Tensor, List[torch.Tensor]]) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def net() -> Tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net(), torch.randn(4, W)


@pytest.mark.parametrize("policy", ["recompute_all", "offload_all", "fixed"])
def test_all_checks_every_released_save_and_finds_nothing_when_exact(policy: str) -> None:
    model, x = net()
    plain = copy.deepcopy(model)
    plan: Any = policy if policy != "fixed" else {"blocks.1:aten.tanh.default:0": Choice.RECOMPUTE,
                                                  ":aten.mul.Tensor:0": Choice.OFFLOAD}
    prov = bagualu2.enable(model, budget=None, policy=plan, gates=[], min_bytes=0, verify="all")
    for _ in range(4):
        assert same(step(plain, x), step(model, x))
    checked = prov.report()["verify"]
    released = sum(prov.report()["saved_bytes_by_choice"][c] for c in ("offload", "recompute"))
    assert released > 0 and checked["checked"] > 0 and checked["mismatches"] == 0, checked
    prov.disable()


def test_off_takes_no_fingerprint() -> None:
    model, x = net()
    prov = bagualu2.enable(model, budget=None, policy="recompute_all", gates=[], min_bytes=0, verify="off")
    for _ in range(3):
        step(model, x)
    assert prov.report()["verify"] == {"mode": "off", "checked": 0, "mismatches": 0, "distrusted": []}
    prov.disable()


def test_sample_checks_one_released_save_in_every_sample_every() -> None:
    model, x = net()
    prov = bagualu2.enable(model, budget=None, policy="offload_all", gates=[], min_bytes=0, verify="sample")
    while prov.runtime.verifier._released < 2 * SAMPLE_EVERY + 3:
        step(model, x)
    released = prov.runtime.verifier._released
    assert released >= 2 * SAMPLE_EVERY
    assert prov.report()["verify"]["checked"] == released // SAMPLE_EVERY
    prov.disable()


def _write_through_numpy(on_mismatch: str) -> Tuple[Net, Net, torch.Tensor, Any]:
    """A fixed plan recomputes what block 2 saves of ``stash``, which the forward wrote through
    a NumPy alias: the rebuild reproduces it as it was made."""
    model, x = net()
    model.numpy_write = True
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=None, policy={":aten.mul.Tensor:0": Choice.RECOMPUTE}, gates=[],
                           min_bytes=0, verify="all", on_mismatch=on_mismatch)
    return model, plain, x, prov


def test_a_rebuild_that_differs_raises_naming_the_operator_micro_batch_and_element() -> None:
    model, plain, x, prov = _write_through_numpy("raise")
    with pytest.raises(bagualu2.ExactnessError) as caught:
        step(model, x)
    error = caught.value
    assert (error.key, error.micro_batch, error.how) == (":aten.mul.Tensor:0", 1, "recomputed")
    assert error.index is not None and error.got == pytest.approx(error.expected / 3, rel=1e-6)
    assert ":aten.mul.Tensor:0 from micro-batch 1, recomputed in forward" in str(error)
    prov.disable()


def test_fallback_counts_a_mismatch_once_warned_and_keeps_that_operator_from_then_on() -> None:
    model, plain, x, prov = _write_through_numpy("fallback")
    with pytest.warns(UserWarning, match="Counted \\(on_mismatch='fallback'\\)"):
        assert not same(step(plain, x), step(model, x))  # what verify caught: the wrong gradient
    for _ in range(3):
        assert same(step(plain, x), step(model, x))
    report = prov.report()["verify"]
    assert report["mismatches"] == 1 and report["distrusted"] == [":aten.mul.Tensor:0"], report
    prov.disable()


def test_a_host_copy_corrupted_before_backward_reads_it_raises() -> None:
    """What a reload read before its copy ended, or a host block reused too early, looks like:
    the host copy backward reads is not what was saved."""
    model, x = net()
    prov = bagualu2.enable(model, budget=None, policy="offload_all", gates=[], min_bytes=0, verify="all")
    stores: List[Any] = []
    prov.runtime.on_frame_end.subscribe(lambda f: stores.extend(s() for s in f.runtime_state.offloads))
    loss = model(x)
    assert stores
    for store in stores:
        store.storage().fill_(7)  # every byte of every host copy
    with pytest.raises(bagualu2.ExactnessError, match="offloaded in forward"):
        loss.backward()
    del loss
    gc.collect()
    prov.disable()


def test_a_rerun_block_that_finds_other_python_state_raises() -> None:
    """``recompute_all`` reruns each block in backward; block 2's input is scaled by Python-side
    state the loop changes between forward and backward, which plain autograd does not read
    again, and the rerun does."""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
            self.gain = 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](torch.sin(x))
            return self.blocks[1](x).square().mean()

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, W)
    own = model.blocks[1].forward
    model.blocks[1].forward = lambda h: own(h * model.gain)
    prov = bagualu2.enable(model, budget=None, policy="recompute_all", gates=[], min_bytes=0, verify="all")
    for _ in range(3):  # traced first, then rerun
        step(model, x)
    loss = model(x)
    model.gain = 2.0
    with pytest.raises(bagualu2.ExactnessError, match="rerun in forward"):
        loss.backward()
    prov.disable()


@pytest.mark.parametrize("value,name", [("yes", "verify"), ("raise!", "on_mismatch")])
def test_bad_options_are_named(value: str, name: str) -> None:
    model, _ = net()
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        bagualu2.enable(model, budget=None, gates=[], **{name: value})


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool]


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
       transpose=st.booleans(), offset=st.integers(0, 3), data=st.data())
def test_a_fingerprint_sees_any_one_element_changed(dtype: torch.dtype, shape: List[int], transpose: bool,
                                                    offset: int, data: st.DataObject) -> None:
    numel = 1
    for n in shape:
        numel *= n
    t = (torch.randn(numel + offset) * 10).to(dtype)[offset:].view(shape)  # a view at any storage offset
    if transpose and t.dim() >= 2:
        t = t.transpose(0, -1)  # a strided view
    fp = fingerprint(t, "k", 1, "offloaded")
    again = fingerprint(t.clone(), "k", 1, "offloaded")
    assert torch.equal(fp.checksum, again.checksum) and torch.equal(fp.sample, again.sample)
    flat = data.draw(st.integers(0, t.numel() - 1), label="element")
    changed = t.clone()
    index = torch.unravel_index(torch.tensor(flat), t.shape) if t.dim() else ()
    if dtype is torch.bool:
        changed[index] = ~changed[index]
    else:  # one bit pattern moved by one: a change no rounding hides
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        changed.view(bits)[index] += 1
    other = fingerprint(changed, "k", 1, "offloaded")
    assert not torch.equal(fp.checksum, other.checksum)
