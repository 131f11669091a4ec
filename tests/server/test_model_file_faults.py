"""The model file damaged while `leap generate` decodes from it: truncated under llama.cpp's
mapping (plain decoding, where nothing checks the file between calls, and flash streaming, which
checks it at every layer), or replaced by another file (flash streaming). Each run ends with
exit 1 and one `leap: error:` line saying what happened: never a death by SIGBUS, never a hang,
never tokens decoded from missing weights."""

import os
import shutil
import subprocess
import time

import pytest

# Long enough that the damage lands mid-run: SmolLM2 counts on for hundreds of tokens.
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"
N = 3000
RUN_TIMEOUT = 300
SIGBUS_LINE = ("leap: error: the model file could not be read through its mapping (SIGBUS): it "
               "was truncated while in use, or the storage failed; run again once the file is whole")


@pytest.fixture
def copy(tmp_path, smollm):
    p = tmp_path / "model.gguf"
    shutil.copyfile(smollm, p)
    return p


def run_and_damage(leap, model, damage, *args):
    """Start `leap generate` on `model`, wait for its first tokens, apply `damage`, and return
    (exit status, stderr lines, stdout)."""
    cmd = [leap, "generate", "-m", str(model), "-p", PROMPT, "-n", str(N), "--ctx", "4096",
           "-t", "1", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    try:
        first = proc.stdout.read(24)  # a few tokens: the model is decoding
        assert len(first) == 24, f"no output before the damage: {proc.stderr.read()!r}"
        damage()
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    lines = [l for l in err.decode(errors="replace").splitlines() if l.strip()]
    return proc.returncode, lines, first + out


def the_error(code, lines):
    """The run's one `leap: error:` line, the last on stderr, after exit 1."""
    assert code == 1, f"exit {code} (a negative status is death by a signal): {lines}"
    errors = [l for l in lines if l.startswith("leap: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    return errors[0]


def truncate(path):
    def go():
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    return go


def replace(path):
    def go():
        other = path.with_name("new.gguf")
        shutil.copyfile(path, other)
        os.replace(other, path)  # a download that renames its result into place
    return go


def test_truncated_under_plain_decoding_is_one_clear_line(leap, copy):
    code, lines, out = run_and_damage(leap, copy, truncate(copy), "--mode", "plain")
    assert code == 1, f"exit {code} (a negative status is death by a signal): {lines}"
    assert lines == [SIGBUS_LINE], lines
    # Every token is at least a byte: N tokens decoded would be N bytes or more.
    assert len(out) < N, "it decoded to the end from a truncated file"


def test_truncated_under_flash_streaming_is_one_clear_line(leap, copy):
    code, lines, _ = run_and_damage(leap, copy, truncate(copy), "--flash-budget", "0.5")
    error = the_error(code, lines)
    # Caught by the streamer's check before the layer that would fault, or (when the
    # truncation lands between its check and the read) by the SIGBUS handler.
    assert "truncated or replaced" in error or error == SIGBUS_LINE, error


def test_replaced_under_flash_streaming_stops_and_says_so(leap, copy):
    started = time.monotonic()
    code, lines, _ = run_and_damage(leap, copy, replace(copy), "--flash-budget", "0.5")
    assert "replaced while in use" in the_error(code, lines), lines
    assert time.monotonic() - started < RUN_TIMEOUT
