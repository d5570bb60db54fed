"""Notes for the user: one line in the log, the summary and the command line's output, the
paragraph in ``uns`` and the HTML report.
"""

import html
import pickle

import anndata as ad

import orca_sc
from orca_sc._notes import Note, line_of, note_fields, stored_notes
from orca_sc.tl import RunRecord


def test_a_note_is_its_paragraph_with_its_line():
    note = Note("Few labels (uns['orca']['x']).", "Few labels. The warm-up fits them closely.")
    assert str(note) == "Few labels. The warm-up fits them closely." and note.line.startswith("Few")
    back = pickle.loads(pickle.dumps(note))  # notes travel between processes with their line
    assert back == note and back.line == note.line
    stored = note_fields([note, "An older paragraph. With a second sentence."])
    assert stored["notes"][0] == str(note) and stored["note_lines"][0] == note.line
    assert stored["note_lines"][1] == "An older paragraph."  # a plain paragraph: first sentence
    assert [n.line for n in stored_notes(stored)] == stored["note_lines"]
    # a record that stored only paragraphs (before the lines) reads back with first sentences
    old = stored_notes({"notes": ["No lines here. Only a paragraph."]})
    assert old[0].line == "No lines here." and str(old[0]) == "No lines here. Only a paragraph."
    assert line_of("one sentence without a full stop") == "one sentence without a full stop"


def test_a_run_s_notes_read_in_lines_that_name_their_detail(demo_run, tmp_path):
    """The demo run (few labels, three hidden types) has notes: each has one line that names
    the ``uns`` key holding its detail, shorter than its paragraph; the summary lists the
    lines, the HTML report the lines and the paragraphs, the h5ad keeps both.
    """
    a = ad.read_h5ad(demo_run["adata"])
    notes = RunRecord.from_uns(a.uns["orca"]).notes
    assert len(notes) >= 3
    for n in notes:
        assert "\n" not in n.line and "uns['orca']" in n.line, n.line
        assert len(n.line) < len(str(n)) and len(n.line) <= 160, n.line
    assert orca_sc.tl.summarize(a, n_markers=0)["notes"] == [n.line for n in notes]
    page = orca_sc.tl.report(a, tmp_path / "r.html").read_text()
    for n in notes:
        assert html.escape(n.line) in page and html.escape(str(n)) in page
