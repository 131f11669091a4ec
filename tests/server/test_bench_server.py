"""`leap bench`'s server:* modes: a stock llama-server (scripts/stock-llama) started by the bench
in its own process on a loopback port, sent each request as token ids, its times read from its own
`timings`, shut down when the bench ends. The report carries them beside the in-process modes,
with time to first token and end-to-end tok/s for every mode."""

import json
import subprocess

import pytest

# A paragraph the model repeats once it has seen it three times: llama.cpp's ngram-mod (24-token
# matches, at least 48 tokens a draft) then drafts from the prompt.
PARAGRAPH = (
    "The kernel keeps a table of every open file for each process. When a process opens a "
    "file, the kernel finds the first free slot in that table, stores a reference to the file "
    "there and returns the slot's number, the file descriptor. Reading, writing and closing all "
    "name the file by that number, and a child created by fork starts with a copy of the table. "
)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    p = tmp_path_factory.mktemp("bench") / "w.jsonl"
    reqs = [
        {"id": "repeat", "task": "summary", "prompt": PARAGRAPH * 3, "max_tokens": 96},
        {"id": "code", "task": "code", "prompt": "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
         "max_tokens": 24},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return p


def bench(leap, gemma, workload, out, *extra):
    return subprocess.run(
        [leap, "bench", "--model", gemma, "--workload", str(workload), "--threads", "2",
         "--ctx", "1536", "--out", str(out), *extra],
        capture_output=True, text=True, timeout=900,
    )


def test_server_modes_run_a_stock_llama_server(leap, gemma, stock_bin, workload, tmp_path):
    out = tmp_path / "r.json"
    r = bench(leap, gemma, workload, out, "--modes", "plain,server:none,server:ngram-mod",
              "--server-bin", str(stock_bin / "llama-server"))
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["n_requests"] == 2
    plain = report["modes"]["plain"]
    none = report["modes"]["server:none"]
    mod = report["modes"]["server:ngram-mod"]
    for m in (plain, none, mod):
        assert m["generated_tokens"] > 0 and m["decode_seconds"] > 0 and m["prefill_seconds"] > 0
        assert m["mean_ttft_seconds"] > 0
        assert 0 < m["e2e_tokens_per_s"] < m["decode_tokens_per_s"]
        assert [q["id"] for q in m["requests"]] == ["repeat", "code"]
        for q in m["requests"]:
            assert q["prompt_tokens"] > 0 and len(q["output_sha256"]) == 64
        # Compared with plain (same hashes of token ids); the stock server's kernels may round
        # otherwise, so equality is reported, not required.
        assert isinstance(m["identical_to_plain"], bool)
    # Plain decoding in the stock server: one token a call, nothing drafted.
    assert none["drafted_tokens"] == 0
    assert none["target_calls"] == none["generated_tokens"] - 2
    # ngram-mod drafted from the repeated paragraph and the server counted what it accepted:
    # fewer calls than tokens.
    assert mod["drafted_tokens"] >= 48, mod
    assert mod["target_calls"] < mod["generated_tokens"] - 2
    assert mod["mean_accepted_per_call"] > 1.2
    # The human table: the end-to-end and per-task one with ratios over the stock modes.
    assert "decode/e2e vs server:none" in r.stderr
    assert "code tok/s" in r.stderr and "summary tok/s" in r.stderr
    # The bench stopped its servers.
    ps = subprocess.run(["pgrep", "-f", f"llama-server.*{gemma}.*-c 1536"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"llama-server left running: {ps.stdout}"


def test_missing_or_unknown_server_is_a_clear_error(leap, gemma, workload, tmp_path):
    r = bench(leap, gemma, workload, tmp_path / "r.json", "--modes", "plain,server:none",
              "--server-bin", "/nonexistent/llama-server")
    assert r.returncode != 0
    assert "/nonexistent/llama-server: no such file" in r.stderr
    r = bench(leap, gemma, workload, tmp_path / "r.json", "--modes", "server:leap")
    assert r.returncode != 0
    assert "server:ngram-mod" in r.stderr
    r = bench(leap, gemma, workload, tmp_path / "r.json", "--modes", "server:none",
              "--flash-budget", "0.5")
    assert r.returncode != 0
    assert "without --flash-budget" in r.stderr


def test_skip_takes_the_later_requests(leap, gemma, workload, tmp_path):
    out = tmp_path / "r.json"
    r = bench(leap, gemma, workload, out, "--modes", "plain", "--skip", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [q["id"] for q in report["modes"]["plain"]["requests"]] == ["code"]
