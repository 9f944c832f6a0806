"""The docs a person reads: README.md short, no paragraph too long to read, no link to a file that
is not there, and every glossary term one the code or the docs use (docs/glossary.md)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, List, Tuple


ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_WORDS = 150
LIST_ITEM = re.compile(r"\s*(?:[-*+]|\d+\.)\s")


def paragraphs(text: str) -> Iterator[Tuple[int, str]]:
    """(first line number, text) of each paragraph: a run of non-blank lines outside code fences,
    headings and tables, each list item its own paragraph; each prose cell of a table too."""
    block: List[str] = []
    start = 0
    fenced = False

    def flush() -> Iterator[Tuple[int, str]]:
        if block:
            yield start, " ".join(block)
        block.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            yield from flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        if not line.strip() or line.startswith("#"):
            yield from flush()
            continue
        if line.lstrip().startswith("|"):
            yield from flush()
            for cell in line.strip().strip("|").split("|"):
                yield number, cell
            continue
        if LIST_ITEM.match(line):
            yield from flush()
        if not block:
            start = number
        block.append(line.strip())
    yield from flush()


def test_the_readme_is_under_200_lines() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < 200, f"README.md has {lines} lines: move detail into docs/"


def long_paragraphs(path: Path, text: str) -> List[str]:
    return [f"{path.relative_to(ROOT)}:{number}: {len(words.split())} words"
            for number, words in paragraphs(text) if len(words.split()) > MAX_WORDS]


def test_no_paragraph_is_over_150_words() -> None:
    long = []
    for path in DOCS:
        long += long_paragraphs(path, path.read_text())
    assert not long, "paragraphs over 150 words:\n" + "\n".join(long)


def built(name: str) -> bool:
    """Whether ``name`` is something the build makes (a test library, a compiled module: a target
    of CMakeLists.txt or setup.py), there only once built."""
    stem = Path(name).name.split(".")[0]
    stem = stem[3:] if stem.startswith("lib") else stem
    return any(re.search(rf"\b{re.escape(stem)}\b", (ROOT / f).read_text()) for f in ("CMakeLists.txt", "setup.py"))


def test_every_relative_link_names_a_file_that_exists() -> None:
    missing = []
    for path in DOCS:
        text = path.read_text()
        # Markdown links, relative to the document.
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                missing.append(f"{path.relative_to(ROOT)}: ({target})")
        # Files named by their path from the repository root (a header and its source together
        # by their stem: csrc/sched/planner; a compiled module by its name).
        for name in re.findall(r"(?<![\w./-])((?:docs|tests|examples|benchmarks|bagualu2|csrc|cmake)/[\w./-]*\w)",
                               text):
            if not (ROOT / name).exists() and not any((ROOT / name).parent.glob(Path(name).name + ".*")) \
                    and not built(name):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def glossary_terms() -> List[str]:
    """The terms docs/glossary.md defines: the bold words that open its entries."""
    return re.findall(r"^- \*\*([^*]+)\*\*", (ROOT / "docs" / "glossary.md").read_text(), flags=re.M)


def test_every_glossary_term_is_one_the_code_or_the_docs_use() -> None:
    terms = glossary_terms()
    assert len(terms) >= 30, terms
    sources = [p.read_text() for p in (ROOT / "bagualu2").rglob("*.py")]
    sources += [p.read_text() for p in (ROOT / "csrc").rglob("*.[ch]*")]
    sources += [p.read_text() for p in DOCS if p.name != "glossary.md"]
    corpus = "\n".join(sources).lower()
    unused = [t for t in terms if t.lower() not in corpus and t.lower().replace(" ", "_") not in corpus]
    assert not unused, f"glossary terms nothing else uses: {unused}"
