"""An edit's hunks: split as diff -u splits them, and any subset applied on its own."""

from __future__ import annotations

import itertools

from northcode.agent.hunks import apply_hunks, diff_hunks

BEFORE = "".join(f"line {n}\n" for n in range(1, 31))
AFTER = BEFORE.replace("line 2\n", "line two\n").replace("line 15\n", "").replace("line 29\n", "line 29\nline 29b\n")


def test_changes_far_apart_are_separate_hunks_with_diff_u_headers():
    hunks = diff_hunks(BEFORE, AFTER)
    assert [h.text.splitlines()[0] for h in hunks] == ["@@ -1,5 +1,5 @@", "@@ -12,7 +12,6 @@", "@@ -27,4 +26,5 @@"]  # as difflib.unified_diff
    assert "-line 2\n+line two\n" in hunks[0].text and "-line 15\n" in hunks[1].text
    assert hunks[2].text.endswith(" line 28\n line 29\n+line 29b\n line 30\n")


def test_every_subset_applies_exactly_its_hunks():
    hunks = diff_hunks(BEFORE, AFTER)
    assert apply_hunks(BEFORE, AFTER, hunks, set(range(3))) == AFTER and apply_hunks(BEFORE, AFTER, hunks, set()) == BEFORE
    for subset in itertools.chain.from_iterable(itertools.combinations(range(3), n) for n in (1, 2)):
        text = apply_hunks(BEFORE, AFTER, hunks, set(subset))
        assert ("line two\n" in text) == (0 in subset) and ("line 15\n" not in text) == (1 in subset)
        assert ("line 29b\n" in text) == (2 in subset) and text.count("\n") == 30 - (1 in subset) + (2 in subset)


def test_line_ends_and_a_missing_last_newline_are_kept():
    before, after = "a\r\nb\r\nc", "A\r\nb\r\nc!"
    hunks = diff_hunks(before, after)
    assert len(hunks) == 1 and apply_hunks(before, after, hunks, {0}) == after
    far_before = "x\r\n" + "".join(f"{n}\r\n" for n in range(10)) + "y"
    far_after = far_before.replace("x\r\n", "X\r\n").replace("\r\ny", "\r\nY")
    first, _ = diff_hunks(far_before, far_after)
    assert apply_hunks(far_before, far_after, diff_hunks(far_before, far_after), {0}) == "X" + far_before[1:]
    assert first.text.startswith("@@ -1,4 +1,4 @@\n-x\r\n+X\r\n")
