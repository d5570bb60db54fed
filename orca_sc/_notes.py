"""Notes for the user: where the data cannot support a call.

A note is two texts. Its paragraph says what happened, why it matters and what to do; it is
kept in the run's record (``uns['orca'][section]['notes']``) and in the HTML report. Its line
says what happened in a few words and names the ``uns`` key that holds the detail; the log,
:func:`orca_sc.tl.summarize` and the command line show the line, so that a run with several
notes still reads in a few lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class Note(str):
    """A note's paragraph (the string itself, so that a list of notes is stored as the list
    of paragraphs) with its one line, :attr:`line`.
    """

    line: str

    def __new__(cls, line: str, paragraph: str) -> Note:
        note = super().__new__(cls, paragraph)
        note.line = line
        return note

    def __reduce__(self):  # pickled with its line (the notes travel between processes)
        return (Note, (self.line, str(self)))


def line_of(note: str) -> str:
    """A note's line; for a paragraph stored without one (an older record), its first
    sentence.
    """
    line = getattr(note, "line", None)
    if line:
        return line
    text = " ".join(str(note).split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def note_fields(notes: Iterable[str]) -> dict[str, list[str]]:
    """What a section of the record stores of its notes: ``notes`` (the paragraphs) and
    ``note_lines`` (their lines, in the same order).
    """
    notes = list(notes)
    return {"notes": [str(n) for n in notes], "note_lines": [line_of(n) for n in notes]}


def stored_notes(section: Mapping[str, Any] | None) -> list[Note]:
    """The notes a section of the record stores (:func:`note_fields`; a record that stored
    only the paragraphs gets their first sentences as lines).
    """
    section = section or {}
    paragraphs = [str(p) for p in section.get("notes", [])]
    lines = [str(x) for x in section.get("note_lines", [])]
    if len(lines) != len(paragraphs):
        lines = [line_of(p) for p in paragraphs]
    return [Note(x, p) for x, p in zip(lines, paragraphs, strict=True)]
