"""The ``bagualu2`` command: every subcommand says what it does and its defaults; ``simulate``'s
defaults fit the model asked for, and it says why policies look alike when nothing crossed."""
from __future__ import annotations

import pytest

from bagualu2.cli import main
from bagualu2.sim.cli import default_ep
from bagualu2.sim.cli import main as simulate


@pytest.mark.parametrize("argv, default", [
    (["demo"], "--seed SEED seed of the weights, batches and spikes (default: 0)"),
    (["bench", "offload"], "(default: bagualu2-bench/offload"),
    (["simulate"], "(default: deepseek-v3-671b)"),
    (["selftest"], "(default: bagualu2-selftest)"),
])
def test_every_subcommand_has_a_description_and_shows_its_defaults(argv, default, capsys) -> None:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert not description.startswith(("options", "positional")), text  # a description before them
    assert default in " ".join(text.split()), text


def test_simulate_default_ep_divides_the_experts_of_every_model() -> None:
    assert (default_ep(256), default_ep(8), default_ep(160), default_ep(0)) == (64, 8, 40, 1)


def test_simulate_runs_mixtral_with_its_defaults_and_says_why_policies_look_alike(capsys) -> None:
    # The default ep was 64, which Mixtral's 8 experts refused; a light load fits keep_all.
    rc = simulate(["--model", "mixtral-8x7b", "--cluster", "h200", "--pp", "4", "--dp", "1",
                   "--steps", "10", "--seq", "512", "--policies", "keep_all,adaptive", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "ep=8" in out
    assert "keep_all never ran out of memory here" in out
