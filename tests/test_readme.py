"""The README tells the truth: its snippet runs as written and shows what it says; and so does
docs/usage.md, where the README sends its reader for the rest: its list of ``report()`` keys is
the code's, and what it says of budgets and gate discovery is what happens."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
USAGE = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()


def _python_blocks() -> list:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def _section(title: str, text: str = USAGE) -> str:
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start:end if end >= 0 else None]


def test_readme_snippet_runs_as_written_and_prints_what_the_readme_says() -> None:
    snippet = _python_blocks()[0]
    assert "bagualu2.enable(" in snippet and "prov.report()" in snippet
    scope: dict = {"__name__": "readme"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    line = printed.getvalue().strip()
    assert line.startswith("True "), line  # "This prints `True` and the bytes ..."
    report = scope["report"]
    assert report["violations"] == 0 and report["budget_bytes"] == 6 << 20
    # "so bagualu2 releases some of it": the budget below a calm micro-batch's all-keep peak
    released = report["saved_bytes_by_choice"]["offload"] + report["saved_bytes_by_choice"]["recompute"]
    assert released > 0
    assert not scope["prov"].enabled and "forward" not in scope["model"].__dict__
    # "a calm micro-batch of this model holds more than 6 MiB when it keeps everything"
    model = scope["model"]
    keep = bagualu2.enable(model, budget=None, policy="keep_all")
    model(next(iter(scope["synthetic_batches"](model.cfg.vocab_size, batch_size=2, seq_len=64)))).backward()
    assert keep.report()["peak_bytes_with_backward"] > 6 << 20


def test_every_report_key_is_documented_and_every_documented_key_exists() -> None:
    table = _section("## What `report()` holds")
    documented = set()
    for row in table.splitlines():
        if row.startswith("| `"):
            documented.update(re.findall(r"`([a-z_]+)`", row.split("|")[1]))
    model = MoETransformer(MoEConfig.tiny())
    prov = bagualu2.enable(model, budget=None)
    assert documented == set(prov.report()), "docs/usage.md's report() table and Provisioner.report() differ"


def test_budget_forms_mean_what_the_readme_table_says_on_cpu() -> None:
    table = _section("## Budgets")
    assert "**no limit**" in table and "fraction of the host's RAM" in table
    model = MoETransformer(MoEConfig.tiny())
    for budget, want in (("auto", None), (None, None), (12345, 12345)):
        prov = bagualu2.enable(model, budget=budget)
        assert prov.budget == want and prov.report()["budget_bytes"] == want
        prov.disable()
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    prov = bagualu2.enable(model, budget=0.25)
    assert prov.budget == int(ram * 0.25)
    prov.disable()


def test_the_unfound_gate_warning_is_the_one_the_readme_quotes() -> None:
    quoted = " ".join(re.search(r"`enable` warns `([^`]+)`", _section("## MoE gates")).group(1).split())
    dense = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.warns(UserWarning) as seen:
        bagualu2.enable(dense, budget=1 << 20)
    assert any(quoted in str(w.message) for w in seen), [str(w.message) for w in seen]


def test_readme_refers_to_no_file_outside_the_repository() -> None:
    root = Path(__file__).resolve().parent.parent
    for name in re.findall(r"\b((?:docs|tests|examples|benchmarks|bagualu2)/[\w./-]+\.(?:md|py))", README):
        assert (root / name).exists(), name
    # Any document it names, with or without a folder, is one the repository has.
    for name in set(re.findall(r"[\w./-]+\.md\b", README)):
        assert (root / name).exists() or any(root.glob(f"**/{name}")), name
