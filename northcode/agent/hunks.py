"""An edit's hunks, for review one by one: the unified diff's hunks, and the text with only some of them applied.

A hunk is one of difflib's grouped opcodes (changes less than 2 * CONTEXT lines apart share one, as in
`diff -u`): the ranges it covers in the old and the new lines, and its `@@` text. Hunks never overlap,
so any subset applies on its own: the old text with each accepted hunk's new lines in its place.
Lines keep their endings, so CRLF files stay CRLF. No UI here.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

CONTEXT = 3  # lines around a change, as in diff -u


@dataclass(frozen=True)
class Hunk:
    old_start: int  # [old_start, old_end) of the old lines, 0-based
    old_end: int
    new_start: int  # [new_start, new_end) of the new lines
    new_end: int
    text: str  # "@@ -a,b +c,d @@" and its lines


def diff_hunks(before: str, after: str) -> list[Hunk]:
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    hunks: list[Hunk] = []
    for group in difflib.SequenceMatcher(None, old, new, autojunk=False).get_grouped_opcodes(CONTEXT):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        lines = [f"@@ -{_range(i1, i2)} +{_range(j1, j2)} @@\n"]
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                lines += [" " + line for line in old[a1:a2]]
                continue
            lines += ["-" + line for line in old[a1:a2]] + ["+" + line for line in new[b1:b2]]
        hunks.append(Hunk(i1, i2, j1, j2, "".join(line if line.endswith("\n") else line + "\n" for line in lines)))
    return hunks


def _range(start: int, end: int) -> str:
    """diff -u's `start,length`, 1-based (an empty range names the line before it)."""
    length = end - start
    return f"{start + 1 if length else start},{length}" if length != 1 else f"{start + 1}"


def apply_hunks(before: str, after: str, hunks: list[Hunk], accepted: set[int] | frozenset[int]) -> str:
    """`before` with the hunks whose index is in `accepted` applied (all of them: `after`)."""
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    out: list[str] = []
    done = 0  # old lines copied so far
    for idx, hunk in enumerate(hunks):
        out += old[done:hunk.old_start]
        out += new[hunk.new_start:hunk.new_end] if idx in accepted else old[hunk.old_start:hunk.old_end]
        done = hunk.old_end
    return "".join(out + old[done:])
