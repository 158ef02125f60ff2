"""The front door and the documents behind it: README.md stays short with the two commands first, every relative link
in README.md and docs/*.md reaches a file of the repository (and a heading of it, for `file.md#anchor`, by GitHub's
slugs), and docs/design.md's module map names every module of the package and no module that is gone."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from conftest import REPO

README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 160
COMMANDS_WITHIN = 30  # lines from the top
RUN_COMMAND, TEST_COMMAND = "bash scripts/run-local.sh", "bash scripts/test.sh"

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the text outside fenced code blocks, where Markdown draws links and headings."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline, image and reference-style link outside code."""
    found = []
    for number, line in prose_lines(text):
        if match := REFERENCE.match(line):
            found.append((number, match[1]))
            continue
        found += [(number, m[1]) for m in LINK.finditer(INLINE_CODE.sub("", line))]
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text lower-cased, punctuation dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"[`*]|<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path.read_text()):
        if match := HEADING.match(line):
            base = slug(match[2])
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(document: Path) -> list[str]:
    """What is wrong with each relative link of `document`: a target outside the repository or missing, or an anchor
    that names no heading of the Markdown file it points into."""
    problems = []
    for number, target in links(document.read_text()):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        where = f"{document.relative_to(REPO)}:{number}: {target}"
        path = (document.parent / unquote(path_part)).resolve() if path_part else document
        if not path.is_relative_to(REPO):
            problems.append(f"{where} leaves the repository")
        elif not path.exists():
            problems.append(f"{where}: no such file {path.relative_to(REPO)}")
        elif anchor and path.suffix == ".md" and unquote(anchor).lower() not in anchors(path):
            problems.append(f"{where}: no heading of {path.relative_to(REPO)} has the anchor #{anchor}")
    return problems


def test_the_slugs_are_githubs():
    assert slug("The levers to 50% MFU") == "the-levers-to-50-mfu"
    assert slug("One GPU: the proof kit on an NVIDIA H200") == "one-gpu-the-proof-kit-on-an-nvidia-h200"
    assert slug("Worked examples (JURECA-DC: 4 x A100 40 GB per node)") == (
        "worked-examples-jureca-dc-4-x-a100-40-gb-per-node"
    )
    assert slug("The `gpt2_small` run, [linked](x.md)") == "the-gpt2_small-run-linked"


def test_the_link_reader_finds_links_and_skips_code(tmp_path):
    text = "\n".join(
        [
            "# Title",
            'see [a](a.md#x), ![pic](img/p.png) and [b, "quoted"](sub/b.md) but not `[c](c.md)`',
            "```",
            "[d](d.md)",
            "```",
            "[ref]: e.md",
            "## Title",
        ]
    )
    assert links(text) == [(2, "a.md#x"), (2, "img/p.png"), (2, "sub/b.md"), (6, "e.md")]
    page = tmp_path / "page.md"
    page.write_text(text)
    assert anchors(page) == {"title", "title-1"}


def test_every_relative_link_of_the_documents_resolves():
    assert (REPO / "docs" / "usage.md") in DOCUMENTS
    problems = [problem for document in DOCUMENTS for problem in broken_links(document)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_a_broken_link_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# Here\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/there.md#here) [gone](docs/gone.md) [bad](docs/there.md#nowhere) [up](../x.md)\n")
    assert broken_links(page) == [
        "README.md:1: docs/gone.md: no such file docs/gone.md",
        "README.md:1: docs/there.md#nowhere: no heading of docs/there.md has the anchor #nowhere",
        "README.md:1: ../x.md leaves the repository",
    ]


def test_the_readme_is_short_with_the_two_commands_first():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail to docs/usage.md"
    top = "\n".join(lines[:COMMANDS_WITHIN])
    assert RUN_COMMAND in top and TEST_COMMAND in top
    assert TEST_COMMAND in (REPO / ".ci" / "run").read_text()  # CI runs the README's test command


def module_map() -> str:
    design = (REPO / "docs" / "design.md").read_text()
    start = design.index("## The module map")
    end = design.find("\n## ", start + 1)
    return design[start : end if end > 0 else None]


def test_the_module_map_is_current():
    """Every module is in the map (a package's `__init__.py` and a `python -m` shim `__main__.py` may be), and the
    map names only modules of the package (or tests) that exist."""
    package = REPO / "src" / "scalelm"
    files = {str(path.relative_to(package)) for path in package.rglob("*.py")}
    modules = {name for name in files if Path(name).name not in ("__init__.py", "__main__.py")}
    named = set(re.findall(r"`((?:\w+/)*\w+\.py)`", module_map()))
    tests = {name for name in named if name.startswith("tests/")}
    assert all((REPO / name).is_file() for name in tests), tests
    missing, gone = modules - named, named - tests - files
    assert not missing, f"modules missing from docs/design.md's module map: {sorted(missing)}"
    assert not gone, f"docs/design.md's module map names modules that do not exist: {sorted(gone)}"
