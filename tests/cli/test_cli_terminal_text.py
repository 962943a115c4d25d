"""What the tables put on an operator's terminal, tried with text from the store that a
terminal treats specially: control characters in a failure's message or a task id, and
keys in wide (CJK, emoji) or decomposed characters."""

from __future__ import annotations

import unicodedata

from celery_dlock.records import Holder, Outcome
from tests.cli.clitools import CliStore, run_cli

#: What a task's failure may carry from its input: an OSC sequence that retitles the
#: terminal window, BEL, a C1 CSI (0x9b, an escape sequence's start on many terminals),
#: a backspace that hides what it follows. (click itself strips ESC [ ... m when the
#: output is not a terminal, so those are not what this checks.)
HOSTILE = "\x1b]0;owned\x07 and \x9b2J and ok\x08\x08XX"


def test_control_characters_from_the_store_are_shown_escaped(file_store: CliStore) -> None:
    """Found by trying: `history --details`, `leases` and `release` wrote a failure's
    message and a caller-chosen task id to the terminal as they were, escape sequences and
    all (a window retitled, a line rewritten)."""
    holder = Holder.current(worker="celery@w1", task_id=f"t{HOSTILE}", task_name="tests.charge")
    lease = file_store.backend.try_acquire("job:esc", holder, None)
    assert lease is not None
    file_store.backend.release(lease, Outcome.FAILED, "ValueError", f"bad input {HOSTILE}")
    assert file_store.backend.try_acquire("job:esc", holder, None) is not None
    outputs = [
        run_cli("--backend", file_store.url, "history", "--details"),
        run_cli("--backend", file_store.url, "leases"),
        run_cli("--backend", file_store.url, "release", "job:esc", input="n\n"),
    ]
    for result in outputs:
        shown = result.stdout + result.stderr
        assert "tests.charge[t" in shown, shown
        assert not any(char in shown for char in "\x1b\x07\x9b\x08"), repr(shown)
        assert r"\x1b]0;owned\x07 and \x9b2J and ok\x08\x08XX" in shown
    assert "bad input \\x1b]0;owned" in outputs[0].stdout


def display_column(line: str, text: str) -> int:
    """The terminal column at which ``text`` starts in ``line``."""
    before = line[: line.index(text)]
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in before
    )


def test_columns_stay_aligned_after_wide_and_combining_characters(file_store: CliStore) -> None:
    """Found by trying: widths were counted in characters, so a row whose key had CJK or
    emoji (two columns each) or a decomposed accent (none) pushed or pulled the rest of its
    row out of line with the others."""
    keys = ["job:注文:42", "job:ünïcødé:😀", "job:cafe\u0301:1", "job:plain:1"]
    for key in keys:
        lease = file_store.backend.try_acquire(key, Holder.current(task_name="t"), None)
        assert lease is not None
    for command in (["leases"], ["history"]):
        if command == ["history"]:
            for key in keys:
                held = file_store.backend.get(key)
                assert held is not None
                file_store.backend.release(held, Outcome.SUCCEEDED)
        lines = run_cli("--backend", file_store.url, *command).stdout.splitlines()
        marker = "pid " if command == ["leases"] else "succeeded"
        assert len(lines) == 1 + len(keys), lines
        starts = {display_column(line, marker) for line in lines[1:]}
        assert len(starts) == 1, lines
