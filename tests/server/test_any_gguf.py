"""Leap on any GGUF model: greedy output must be plain decoding's, token for token, on
architectures Leap was not tuned on.

`tests/models/random_gguf.py` writes small random-weight models here, at test time (never
committed), with SmolLM2's tokenizer: llama, qwen2 (q/k/v biases), qwen3 (q/k norms), phi3
(fused qkv and gate+up) and gemma2 (sliding-window attention over 32 cells, which every
request here crosses; soft-capping), each in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and F16. Random
weights give nearly tied logits: exactly where a row whose result depends on its batch would
flip a greedy token. `leap bench` runs plain decoding and three of Leap's modes on four
prompts of 128 tokens each (the default `leap`, token trees `leap:tree`, and `leap:sam-fixed`,
whose retrieval drafts do not depend on measured costs, so whether they are accepted does not
depend on the machine's load), and every mode's tokens must be plain's.

Mamba and LFM2 (a hybrid) keep recurrent state, which llama.cpp cannot roll back past a
rejected draft: there Leap says so in one warning line and decodes plainly, which is checked
too, in `leap bench` and in `leap serve` (whose prompt reuse keeps a cached prefix, which
recurrent state cannot truncate either).

About 3 minutes on 2 idle cores (5 with other builds running), most of it `leap bench` (34
runs of 2-12 s)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, Server, complete
from test_server import leap_generate

sys.path.insert(0, str(REPO / "tests" / "models"))
try:
    import random_gguf
except ImportError as e:  # the gguf package (scripts/setup installs it)
    random_gguf = None
    IMPORT_ERROR = e

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16"]
ATTENTION = ["llama", "qwen2", "qwen3", "phi3", "gemma2"]
# Recurrent (mamba) and hybrid (lfm2): the fallback does not depend on the weights' type.
RECURRENT = [("mamba", "Q4_0"), ("mamba", "F16"), ("lfm2", "Q8_0"), ("lfm2", "Q5_1")]
MODES = ["leap", "leap:tree", "leap:sam-fixed"]
MAX_TOKENS = 128
FALLBACK = "keeps recurrent state, which llama.cpp cannot roll back past a rejected draft"

PROMPTS = [
    ("prose", "summary",
     "The river rises in the hills to the north of the town and runs south through farmland, "
     "past the old mill and under the stone bridge, before it turns east towards the sea. In "
     "spring the water is high and brown; in late summer it is low and clear, and children fish "
     "from the bridge.\n\nSummary:"),
    ("code", "code",
     "def count_words(text):\n    \"\"\"Return a dict mapping each word of text to how often it "
     "occurs.\"\"\"\n    counts = {}\n    for word in text.split():\n        counts[word] = "
     "counts.get(word, 0) + 1\n    return counts\n\n\ndef most_common(text, n):\n    \"\"\"Return "
     "the n most common words of text.\"\"\"\n"),
    # Repetitive: retrieval drafts from the prompt at once.
    ("repeat", "rag", "apple banana cherry " * 8 + "apple"),
    ("list", "rag",
     "Shopping list:\n1. bread\n2. milk\n3. eggs\n4. butter\n5. cheese\n6. apples\n7. rice\n8."),
]

# On a shared 2-core machine OpenMP's spinning workers make a 2-thread run 10-25x slower (30 s
# instead of 2.4 s for one model here); sleeping workers change no result.
ENV = {"OMP_WAIT_POLICY": "passive", **os.environ}


@pytest.fixture(scope="module")
def tokenizer(smollm):
    if random_gguf is None:
        pytest.fail(f"tests/models/random_gguf.py needs the gguf package ({IMPORT_ERROR}): "
                    "python3 -m pip install gguf==0.17.1 (scripts/setup installs it)")
    return random_gguf.read_tokenizer(smollm)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    p = tmp_path_factory.mktemp("any_gguf") / "w.jsonl"
    p.write_text("".join(
        json.dumps({"id": i, "task": t, "prompt": prompt, "max_tokens": MAX_TOKENS}) + "\n"
        for i, t, prompt in PROMPTS))
    return p


@pytest.fixture
def model(request, tokenizer, tmp_path):
    """The random model of the test's (arch, type), written to its own directory and removed
    after the test."""
    arch, qtype = request.param
    path = tmp_path / f"{arch}-{qtype}.gguf"
    random_gguf.write(arch, qtype, tokenizer, str(path))
    yield str(path)
    path.unlink(missing_ok=True)


def bench(leap, model, workload, out):
    r = subprocess.run(
        [leap, "bench", "--model", model, "--workload", str(workload), "--threads", "2",
         "--ctx", "1024", "--modes", ",".join(["plain", *MODES]), "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=ENV,
    )
    assert r.returncode == 0, f"leap bench on {model} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(out.read_text()), r.stderr


def check_identical(report):
    """Every mode generated MAX_TOKENS tokens per request, plain's tokens (same hashes)."""
    plain = report["modes"]["plain"]
    want = {q["id"]: q["output_sha256"] for q in plain["requests"]}
    assert len(want) == len(PROMPTS)
    for name in MODES:
        m = report["modes"][name]
        diff = m["differing_requests"]
        assert m["identical_to_plain"] and not diff, f"{name} differs from plain on {diff}"
        # (`leap bench` compares a mode's requests with plain's pairwise: all of them here.)
        assert sorted(q["id"] for q in m["requests"]) == sorted(want), (name, m["requests"])
        for q in m["requests"]:
            assert q["generated_tokens"] == MAX_TOKENS, (name, q["id"], q["generated_tokens"])
            assert q["output_sha256"] == want[q["id"]], (name, q["id"])


def accepted(m):
    """Drafted tokens a mode accepted: every token after each request's first (which comes
    with the prompt) that took no target call of its own. Exact for tree modes, whose every
    call verifies; self-drafting (`leap` on these models) also counts its drafting calls."""
    return m["generated_tokens"] - len(m["requests"]) - m["target_calls"]


@pytest.mark.parametrize("model", [(a, t) for a in ATTENTION for t in TYPES], indirect=True,
                         ids=lambda p: "-".join(p))
def test_leap_is_plain_on_random_models(leap, model, workload, tmp_path):
    report, stderr = bench(leap, model, workload, tmp_path / "r.json")
    check_identical(report)
    assert FALLBACK not in stderr
    for name in MODES:
        assert report["modes"][name]["drafted_tokens"] > 0, (name, "drafted nothing")
    # Drafts were accepted: verification took several tokens a call (the cost-driven modes'
    # trees depend on measured times, so only the fixed one is held to it).
    fixed = report["modes"]["leap:sam-fixed"]
    assert accepted(fixed) > 0, fixed


@pytest.mark.parametrize("model", RECURRENT, indirect=True, ids=lambda p: "-".join(p))
def test_recurrent_model_falls_back_to_plain(leap, model, workload, tmp_path):
    report, stderr = bench(leap, model, workload, tmp_path / "r.json")
    check_identical(report)
    # One warning line for the process (three engines), naming the file.
    warned = [l for l in stderr.splitlines() if FALLBACK in l]
    assert len(warned) == 1 and os.path.basename(model) in warned[0], stderr[-2000:]
    plain = report["modes"]["plain"]
    for name in MODES:
        m = report["modes"][name]
        assert m["drafted_tokens"] == 0 and m["target_calls"] == plain["target_calls"], (name, m)


@pytest.mark.parametrize("model", [("mamba", "Q8_0"), ("lfm2", "Q4_0")], indirect=True,
                         ids=lambda p: "-".join(p))
def test_recurrent_model_served_with_prompt_reuse(leap, model):
    """`leap serve` keeps a slot's last prompt and output and prefills only what a request
    adds; recurrent state cannot drop the part a new prompt does not share, so that request
    is prefilled whole (before, llama.cpp refused the batch: a 500). Each answer must be
    `leap generate --mode plain`'s."""
    shared = "apple banana cherry " * 4
    prompts = [shared + "The river", shared + "The mill", shared + "The river"]
    want = {p: leap_generate(leap, model, p, 32) for p in set(prompts)}
    s = Server(leap, model, ctx=512, parallel=1, threads=1)
    try:
        for p in prompts:
            assert complete(s.port, p, 32)["choices"][0]["text"] == want[p], (p, s.stderr())
        assert sum(FALLBACK in l for l in s.lines) == 1, s.stderr()
    finally:
        s.stop_and_check()
