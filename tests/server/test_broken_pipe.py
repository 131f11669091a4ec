"""A reader that stops early ends `leap` quietly: `leap info MODEL --tensors | head -1` exits 0
with nothing on stderr about it, never a panic. Rust starts with SIGPIPE ignored, so a write to
the closed pipe fails with EPIPE; `println!` would panic on it ("failed printing to stdout"),
`leap` returns it and `main` exits 0 (the exit codes in cli/src/main.rs)."""

import fcntl
import os
import subprocess

import pytest

TIMEOUT = 120


def check_quiet(what, rc, err):
    assert "panicked" not in err and "RUST_BACKTRACE" not in err, f"{what}: a panic:\n{err}"
    assert "leap: error" not in err, f"{what}: an error:\n{err}"
    assert rc == 0, f"{what}: exit {rc}, not 0:\n{err}"


def test_head_reads_one_line(leap, gemma):
    """The pipeline as a user types it, with `head -1` reading. The pipe's buffer is shrunk to
    one page, less than the tensor list, so `leap` is still writing when `head` exits."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    head = subprocess.Popen(["head", "-1"], stdin=r, stdout=subprocess.PIPE, text=True)
    os.close(r)
    try:
        p = subprocess.run([leap, "info", gemma, "--tensors"], stdin=subprocess.DEVNULL,
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
    finally:
        os.close(w)
        line, _ = head.communicate(timeout=TIMEOUT)
    assert line.startswith("file "), line
    check_quiet("info --tensors | head -1", p.returncode, p.stderr)


@pytest.mark.parametrize("args", [
    ["info", "MODEL", "--tensors"],
    ["info", "MODEL", "--flash-budget", "0.5"],
    ["models"],
    ["models", "path", "smollm2-135m"],
    ["generate", "-m", "MODEL", "-p", "Hello", "-n", "4", "-t", "1"],
], ids=lambda a: " ".join(a))
def test_stdout_closed_before_the_first_write(leap, smollm, args):
    """stdout a pipe whose reader is gone before `leap` starts: its first write fails, every
    time, whatever the scheduling."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([leap] + [smollm if a == "MODEL" else a for a in args],
                           stdin=subprocess.DEVNULL, stdout=w, stderr=subprocess.PIPE, text=True,
                           timeout=TIMEOUT)
    finally:
        os.close(w)
    check_quiet(" ".join(args), p.returncode, p.stderr)
