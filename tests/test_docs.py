"""The definitions the code cites are in the repository: every `docs/spec.md §N` reference names a
section of docs/spec.md, and no reference points at a document a clone does not have."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = [p for folder in ("src", "tests", "bench", "configs") for p in sorted((ROOT / folder).rglob("*"))
        if p.suffix in (".py", ".yaml")]
CITES = re.compile(r"docs/spec\.md §(\d+)((?:(?:, | and | or )§\d+)*)")
OUTSIDE = re.compile(r"SPEC §|DESIGN\.md|shared/SPEC|shared/data/README")


def spec_sections() -> set[int]:
    return {int(n) for n in re.findall(r"^## §(\d+) ", (ROOT / "docs" / "spec.md").read_text(), flags=re.M)}


def test_every_spec_reference_names_a_section():
    sections, cited = spec_sections(), {}
    assert sections == set(range(1, len(sections) + 1))  # numbered in order, none skipped
    for path in CODE:
        for line_no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for first, more in CITES.findall(line):
                for n in [first, *re.findall(r"§(\d+)", more)]:
                    cited.setdefault(int(n), []).append(f"{path.relative_to(ROOT)}:{line_no}")
    missing = {n: where for n, where in cited.items() if n not in sections}
    assert not missing, f"references to sections docs/spec.md does not have: {missing}"
    assert len(cited) >= 6  # the code does cite it (a broken pattern would find nothing)


def test_no_reference_leaves_the_repository():
    outside = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in CODE
               for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
               if OUTSIDE.search(line) and p != Path(__file__).resolve()]
    assert not outside, "\n".join(outside)
