"""Resume equals the uninterrupted run under torchtitan 0.3.0: a tiny Qwen3-MoE parallelized by
torchtitan (FSDP2 + EP=2, 2 gloo ranks), checkpointed and loaded by torchtitan's own
``CheckpointManager`` (DCP), the provisioner among its states
(``bagualu2.integrations.torchtitan.add_to_checkpoint``).

The first launch trains the whole trace and checkpoints part way (model, optimizers,
learning-rate schedulers, a train state with each rank's RNG, which draws its batches, and each
rank's provisioner state); a second launch, new processes, builds the run again, loads the
checkpoint and trains the rest. Every later loss and gradient is bit-exact with the run that
never stopped; the resumed run profiles and calibrates nothing, decides from the bytes the
uninterrupted run decided from (its first forward, FSDP2's first in the new processes,
included: nothing runs before ``bagualu2.enable``), and plans the first spike after the resume on the rank it lands
on (rank 1: rank 0's tokens spike onto rank 1's expert). A third launch leaves the provisioner
out of the load (torchtitan's ``exclude_from_loading``): the control, which starts over and does
not plan that spike. Rank code: tests/torchtitan_resume_ranks.py.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the helpers below

from engine_required import TORCHTITAN, require  # noqa: E402

require(*TORCHTITAN)


import torchtitan_ranks as ranks  # noqa: E402
import torchtitan_resume_ranks as resume  # noqa: E402
from pipeline_harness import launch  # noqa: E402

LAUNCH_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def titan_runs(tmp_path_factory: Any) -> Dict[str, List[Dict[str, Any]]]:
    out = tmp_path_factory.mktemp("resume_torchtitan")
    runs = {}
    for mode in ("whole", "resumed", "cold"):
        launch(resume.resume_case, 2, mode, str(out), timeout_s=LAUNCH_TIMEOUT_S)
        runs[mode] = [torch.load(out / f"{mode}{r}.pt", weights_only=False) for r in range(2)]
    # torchtitan's layout: one folder per saved step, holding DCP's metadata.
    assert (out / "checkpoint" / f"step-{resume.CHECKPOINT_AFTER}" / ".metadata").is_file()
    return runs


@pytest.mark.slow
def test_torchtitan_resumed_ranks_are_bit_exact_with_the_uninterrupted_run(titan_runs: Dict[str, Any]) -> None:
    for rank in range(2):
        whole, resumed = titan_runs["whole"][rank], titan_runs["resumed"][rank]
        assert len(whole["steps"]) == len(resumed["steps"]) == len(resume.TRACE) - resume.CHECKPOINT_AFTER
        bad = [(i, m[:3]) for i, m in enumerate(map(ranks.mismatches, whole["steps"], resumed["steps"])) if m]
        assert not bad, f"rank {rank}: not bit-exact at step(s) after the checkpoint {bad}"
        lrs = [s["lr"] for s in resumed["steps"]]
        assert lrs == [s["lr"] for s in whole["steps"]] and len(set(lrs)) > 1, lrs  # the schedule went on


@pytest.mark.slow
def test_torchtitan_ranks_resume_their_own_state_and_plan_the_first_spike(titan_runs: Dict[str, Any]) -> None:
    first = resume.CHECKPOINT_AFTER
    for rank in range(2):
        whole, resumed, cold = (titan_runs[m][rank] for m in ("whole", "resumed", "cold"))
        assert resumed["state_keys"] == [f"rank_{rank}"]
        # Records: (micro-batch, traced, calibrating, first decision's predicted bytes, violations).
        assert any(r[2] for r in whole["records"] if r[0] < first), "nothing calibrated before the checkpoint"
        later = [r[:4] for r in whole["records"] if r[0] >= first]
        assert [r[:4] for r in resumed["records"]] == later, rank
        assert not any(r[2] for r in resumed["records"])  # no calibrating micro-batch
        assert resumed["profiled"] == whole["profiled"]  # nothing profiled again
        assert resumed["records"][0][0] == first  # the micro-batch count went on from the checkpoint
        assert not any(r[4] for r in whole["records"] + resumed["records"])  # the budget held
        if rank == 1:  # where the spike lands: traced, and a gate's plan released
            assert resumed["records"][0][1]
            assert first in whole["planned"] and first in resumed["planned"]
            # The control starts over: its first micro-batch (that spike) is profiled, not planned.
            assert cold["records"][0][1] and 0 not in cold["planned"]


# Slow lane: CI installs torchtitan only there (the fast lane would skip it).
@pytest.mark.slow
def test_add_to_checkpoint_puts_the_provisioner_among_the_checkpointer_states(tmp_path: Path) -> None:
    import bagualu2
    from bagualu2.integrations.torchtitan import add_to_checkpoint
    from bagualu2.models import MoEConfig, MoETransformer
    from torchtitan.components.checkpoint import CheckpointManager

    model = MoETransformer(MoEConfig.tiny())
    prov = bagualu2.enable(model, budget=None)
    try:
        def manager(enable: bool) -> Any:
            return CheckpointManager.Config(enable=enable, keep_latest_k=0).build(
                dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
                sd_adapter=None, base_folder=str(tmp_path))

        off = manager(False)
        add_to_checkpoint(off, prov)  # saves and loads nothing: left as it is
        assert not hasattr(off, "states")
        on = manager(True)
        add_to_checkpoint(on, prov)
        add_to_checkpoint(on, prov)  # again: the same state, nothing to refuse
        assert on.states["bagualu2"] is prov
        with pytest.raises(ValueError, match="already saves ModelWrapper as 'model'"):
            add_to_checkpoint(on, prov, key="model")
        assert on.states["model"] is not prov
    finally:
        prov.disable()
