"""Every bad input in docs/bad-input.md, run as the table writes it: the documented exit status,
one line on stderr that is the documented one (`…` matches any text), and never a panic. The
table is this test's input, so the documentation cannot drift from what Leap does."""

import json
import re
import shlex
import subprocess

import pytest

from conftest import REPO

DOC = REPO / "docs" / "bad-input.md"
# A model that does not fit in a way only loading finds takes a few seconds; nothing here decodes
# more than 19 tokens of SmolLM2.
TIMEOUT = 180


def rows():
    """(bad input, argv words, exit, expected line) from the doc's table."""
    out = []
    inside = False
    for line in DOC.read_text().splitlines():
        if line.startswith("| Bad input"):
            inside = True  # the table's header; the table ends at the first other line
            continue
        if not inside or line.startswith("|---"):
            continue
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, f"a row of {DOC.name} needs 4 cells: {line}"
        what, cmd, code, says = cells
        out.append((what, shlex.split(unquote(cmd)), int(code), unquote(says)))
    return out


def unquote(cell):
    """A markdown code span's text (`x` or `` x ``)."""
    if cell.startswith("`` ") and cell.endswith(" ``"):
        return cell[3:-3]
    assert cell.startswith("`") and cell.endswith("`"), f"not a code span: {cell}"
    return cell[1:-1]


def pattern(says):
    """The expected line as a regex: `…` is any text, the rest literal."""
    return re.compile("^" + ".*".join(re.escape(p) for p in says.split("…")) + "$")


@pytest.fixture(scope="module")
def files(tmp_path_factory, leap, smollm, gemma):
    d = tmp_path_factory.mktemp("bad")
    model = open(smollm, "rb").read()
    (d / "half.gguf").write_bytes(model[: len(model) // 2])
    (d / "header.gguf").write_bytes(model[:100_000])
    (d / "text.txt").write_text("word " * 100 + "\n")
    (d / "empty.gguf").write_bytes(b"")
    (d / "long.txt").write_text("word " * 100 + "\n")
    (d / "w1.jsonl").write_text(json.dumps(
        {"id": "one", "task": "summary", "prompt": "Summarise: " + "the cat sat on the mat. " * 8,
         "max_tokens": 16}) + "\n")
    (d / "bad.jsonl").write_text('{"id": "one", "task": \n')
    return {
        "SMOL": smollm, "GEMMA": gemma, "HALF": d / "half.gguf", "HEADER": d / "header.gguf",
        "TEXT": d / "text.txt", "EMPTY": d / "empty.gguf", "DIR": d, "LONG": d / "long.txt",
        "W1": d / "w1.jsonl", "BADW": d / "bad.jsonl",
    }


def test_the_table_covers_what_the_issue_names():
    said = " ".join(what for what, *_ in rows())
    for must in ["flash budget above 1", "flash budget 0", "beyond the model", "empty prompt",
                 "prompt longer than the context", "beyond the context", "directory",
                 "truncated", "not a GGUF", "no threads", "draft model"]:
        assert must in said, f"{DOC.name} has no row for {must!r}"


@pytest.mark.parametrize("what,argv,code,says", rows(), ids=[r[0] for r in rows()])
def test_bad_input(leap, files, what, argv, code, says):
    assert argv[0] == "leap", argv
    cmd = [leap] + [sub(w, files) for w in argv[1:]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                       stdin=subprocess.DEVNULL)
    err = r.stderr
    assert "panicked" not in err and "RUST_BACKTRACE" not in err, f"{what}: a panic:\n{err}"
    assert r.returncode == code, f"{what}: exit {r.returncode}, not {code}:\n{err}"
    lines = [l for l in err.splitlines() if l.strip()]
    want = pattern(says)
    if code != 0:
        assert len(lines) == 1, f"{what}: not one line:\n{err}"
        assert want.match(lines[0]), f"{what}:\n got  {lines[0]}\n want {says}"
    else:
        assert any(want.match(l) for l in lines), f"{what}: no line like\n {says}\nin\n{err}"


def sub(word, files):
    """A command word with the table's names for files replaced by this run's."""
    if word in files:
        return str(files[word])
    if word.startswith("DIR/"):
        return str(files["DIR"]) + word[3:]
    return word
