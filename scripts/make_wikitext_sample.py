"""Regenerate the small WikiText-2 sample shipped in resources/wikitext-2-sample/.

Developer tool, never run by the pipeline: it reads the full WikiText-2 token files
(wiki.valid.tokens, wiki.test.tokens from the pytorch/examples copy) and keeps whole
articles until each split reaches its word budget. The real train split is not
available on the development machines, so the sample's train split is taken from
the start of the validation file and its validation split from the articles after it.

    python scripts/make_wikitext_sample.py SOURCE_DIR resources/wikitext-2-sample
"""

import sys
from pathlib import Path


def articles(path: Path) -> list[list[str]]:
    """Split a WikiText file into articles (a top-level heading ' = Title = ' starts one)."""
    result: list[list[str]] = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        stripped = line.strip()
        is_title = stripped.startswith("= ") and not stripped.startswith("= =")
        if is_title or not result:
            result.append([])
        result[-1].append(line)
    return result


def take(arts: list[list[str]], words: int) -> tuple[list[str], list[list[str]]]:
    lines: list[str] = []
    count = 0
    while arts and count < words:
        article = arts.pop(0)
        lines.extend(article)
        count += sum(len(line.split()) for line in article)
    return lines, arts


def main(source: str, target: str) -> None:
    src, out = Path(source), Path(target)
    valid = articles(src / "wiki.valid.tokens")
    test = articles(src / "wiki.test.tokens")
    train_lines, valid = take(valid, 80_000)
    valid_lines, _ = take(valid, 10_000)
    test_lines, _ = take(test, 10_000)
    out.mkdir(parents=True, exist_ok=True)
    for name, lines in (("train", train_lines), ("validation", valid_lines), ("test", test_lines)):
        (out / f"{name}.txt").write_text("".join(lines), encoding="utf-8")
        print(f"{name}: {sum(len(line.split()) for line in lines)} words")


if __name__ == "__main__":
    main(*sys.argv[1:3])
