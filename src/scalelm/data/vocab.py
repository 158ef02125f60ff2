"""Word vocabulary: special tokens first, then words by descending frequency (ties alphabetical)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

UNK = "<unk>"
EOS = "<eos>"
SPECIALS = (UNK, EOS)
UNK_ID, EOS_ID = 0, 1


def words_of(lines: Iterable[str], lowercase: bool) -> Iterator[list[str]]:
    """Whitespace words of each non-blank line, followed by <eos>. Blank lines carry no words and are skipped."""
    for line in lines:
        words = (line.lower() if lowercase else line).split()
        if words:
            yield words + [EOS]


def build_vocab(counts: Counter[str], min_freq: int) -> list[str]:
    words = [w for w, c in counts.items() if c >= min_freq and w not in SPECIALS]
    words.sort(key=lambda w: (-counts[w], w))
    return [*SPECIALS, *words]
