"""Leap's aarch64 build on emulated ARM cores (qemu-user): greedy `leap` gives plain decoding's
tokens with Leap's device computing, `leap serve` answers a chat completion, and the C API
example runs against the aarch64 `libleap.so`.

Run by `make test-aarch64` (scripts/aarch64 test), which cross-builds first and sets
LEAP_AARCH64_DIR (the aarch64 release directory) and LEAP (the host's x86-64 `leap`, used only
to find the cached models). Emulation is 10-50x slower than a real core: these tests check
results, never speed, and keep generations short.
"""

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "server"))
import conftest  # noqa: E402
from conftest import Server, request, model_path  # noqa: E402

SYSROOT = "/usr/aarch64-linux-gnu"
# NEON only (armv8.0-a, the baseline); dotprod and fp16 (armv8.2-a); everything qemu has (i8mm,
# SVE, ...): each of Leap's kernel variants runs on at least one of them.
CPUS = ["cortex-a53", "cortex-a76", "max"]
STATS = re.compile(r"leap: leap-cpu computed (\d+) nodes \((\d+) attention nodes, (\d+) query rows sparse\)")
# Text with repeats, so that drafts are accepted and verification calls carry several rows.
PROMPT = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n"
)
EMULATED_TIMEOUT = 900


@pytest.fixture(scope="session")
def arm_dir():
    d = os.environ.get("LEAP_AARCH64_DIR")
    if not d or not os.access(Path(d) / "leap", os.X_OK):
        pytest.exit("LEAP_AARCH64_DIR must name the aarch64 release directory (make test-aarch64)", returncode=1)
    return Path(d)


@pytest.fixture(scope="session")
def host_leap():
    p = os.environ.get("LEAP", str(REPO / "target" / "release" / "leap"))
    assert os.access(p, os.X_OK), f"no host leap at {p}"
    return p


def qemu(cpu):
    # LD_LIBRARY_PATH: the sysroot's own C library, not Debian's multiarch one (scripts/aarch64).
    return ["qemu-aarch64", "-L", SYSROOT, "-E", f"LD_LIBRARY_PATH={SYSROOT}/lib", "-cpu", cpu]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAP_", "GGML_"))}
    env.update(extra)
    return env


def generate(arm_dir, cpu, model, mode, *extra, n=16):
    cmd = [*qemu(cpu), str(arm_dir / "leap"), "generate", "--model", model, "--prompt", PROMPT,
           "-n", str(n), "--threads", "2", "--mode", mode, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=EMULATED_TIMEOUT,
                       env=clean_env(LEAP_STATS="1"), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}"
    m = STATS.search(r.stderr)
    assert m, f"no LEAP_STATS line:\n{r.stderr[-2000:]}"
    return r.stdout, int(m.group(1)), r.stderr


# Which kernel variant each emulated core gets (leap -v names it per weight type).
VARIANT = {"cortex-a53": "neon kernel", "cortex-a76": "neon+sdot kernel"}
PLAIN = {}


def plain_text(arm_dir, model):
    """Plain decoding by ggml alone (`--kernels ggml`), once per model: ggml is built for
    armv8-a, so every core runs the same instructions for it."""
    if model not in PLAIN:
        text, nodes, _ = generate(arm_dir, "cortex-a53", model, "plain", "--kernels", "ggml")
        assert text.strip(), "plain decoding generated text"
        assert nodes == 0, "with --kernels ggml nothing runs on Leap's device"
        PLAIN[model] = text
    return PLAIN[model]


@pytest.mark.parametrize("cpu", ["cortex-a53", "cortex-a76"])
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_greedy_leap_is_plain_decoding_with_the_device_computing(arm_dir, host_leap, name, cpu):
    model = model_path(host_leap, name)
    plain = plain_text(arm_dir, model)
    leap, nodes, err = generate(arm_dir, cpu, model, "leap", "-v")
    assert leap == plain, f"{name} on {cpu}: leap differs from plain decoding\nleap: {leap!r}\nplain: {plain!r}\n{err[-3000:]}"
    assert nodes > 0, f"Leap's device computed nothing:\n{err[-3000:]}"
    assert f"products on Leap's {VARIANT[cpu]}" in err, err[-3000:]
    assert "does not reproduce ggml" not in err, err[-3000:]


def wrapper(tmp_path, arm_dir, cpu):
    """An executable that runs the aarch64 `leap` under qemu (what tests/server's Server starts)."""
    w = tmp_path / f"leap-{cpu}"
    w.write_text(f'#!/bin/sh\nexec {" ".join(qemu(cpu))} "{arm_dir / "leap"}" "$@"\n')
    w.chmod(w.stat().st_mode | stat.S_IXUSR)
    return str(w)


def test_leap_serve_answers_a_chat_completion(tmp_path, monkeypatch, arm_dir, host_leap):
    model = model_path(host_leap, "smollm2-135m")
    # Loading and the kernels' checks run emulated: more time to get ready, for this test only.
    monkeypatch.setattr(conftest, "READY_TIMEOUT", 600)
    s = Server(wrapper(tmp_path, arm_dir, "cortex-a76"), model, ctx=512, parallel=1, threads=2)
    try:
        status, _, body = request(s.port, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 8, "temperature": 0,
        }, timeout=EMULATED_TIMEOUT)
        assert status == 200, body
        r = json.loads(body)
        assert r["choices"][0]["message"]["content"].strip(), r
        assert r["usage"]["completion_tokens"] > 0, r
    finally:
        s.stop_and_check()


def test_the_c_example_runs_on_aarch64(tmp_path, arm_dir, host_leap):
    exe = tmp_path / "leap_example"
    subprocess.run(
        ["aarch64-linux-gnu-gcc", "-O2", "-std=c11", "-Wall", "-Werror", "-I", str(REPO / "include"),
         str(REPO / "tests" / "c" / "leap_example.c"), "-o", str(exe), "-L", str(arm_dir), "-lleap",
         f"-Wl,-rpath,{arm_dir}"],
        check=True, timeout=120,
    )
    model = model_path(host_leap, "smollm2-135m")
    outs = {}
    for mode in ["leap", "plain"]:
        r = subprocess.run([*qemu("cortex-a76"), str(exe), model, mode, "16"], capture_output=True,
                           text=True, timeout=EMULATED_TIMEOUT, env=clean_env(), stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"leap_example {mode} exited {r.returncode}:\n{r.stderr[-3000:]}"
        assert re.search(r"^tokens \d+$", r.stderr, re.M), r.stderr
        assert "finish stop, the text cut there" in r.stderr, r.stderr
        outs[mode] = r.stdout
    assert outs["leap"].strip() and outs["leap"] == outs["plain"]
