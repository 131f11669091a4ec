"""Fixtures for `leap serve`'s end-to-end tests: the binary, the models, and servers started as
subprocesses on a free port of 127.0.0.1 (the only address these tests contact)."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
LISTENING = re.compile(r"leap serve: listening on http://127\.0\.0\.1:(\d+) ")
# Every HTTP call has a timeout; a generation here is 16-32 tokens (a few seconds at most).
HTTP_TIMEOUT = 60
READY_TIMEOUT = 120
STOP_TIMEOUT = 60


def leap_path():
    return Path(os.environ.get("LEAP", REPO / "target" / "release" / "leap"))


@pytest.fixture(scope="session")
def leap():
    p = leap_path()
    if not os.access(p, os.X_OK):
        pytest.exit(f"no leap binary at {p} (set LEAP=/path/to/leap or `make build`)", returncode=1)
    return str(p)


def model_path(leap, name):
    r = subprocess.run([leap, "models", "path", name], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or not r.stdout.strip():
        pytest.exit(
            f"`leap models path {name}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}"
            " (`make models` fetches the models)",
            returncode=1,
        )
    return r.stdout.strip()


@pytest.fixture(scope="session")
def stock_bin():
    """The bin/ directory of the stock llama.cpp (scripts/stock-llama; LEAP_STOCK_BIN names it)."""
    d = os.environ.get("LEAP_STOCK_BIN")
    if not d:
        # Builds it when missing (about 11 minutes on 2 cores), else prints the cached path.
        r = subprocess.run([str(REPO / "scripts" / "stock-llama")], capture_output=True,
                           text=True, timeout=3600)
        assert r.returncode == 0, f"scripts/stock-llama failed:\n{r.stderr[-3000:]}"
        d = r.stdout.strip()
    assert (Path(d) / "llama-server").exists(), f"no llama-server in {d}"
    return Path(d)


@pytest.fixture(scope="session")
def smollm(leap):
    return model_path(leap, "smollm2-135m")


@pytest.fixture(scope="session")
def gemma(leap):
    return model_path(leap, "gemma3-270m")


class Server:
    """`leap serve` as a subprocess: its port (parsed from the line it prints on stderr) and
    its stderr, kept for diagnostics."""

    def __init__(self, leap, model, *args, ctx=1024, parallel=1, threads=1, env=None):
        self.cmd = [
            leap, "serve", "-m", model, "--host", HOST, "--port", "0", "--threads", str(threads),
            *(["--parallel", str(parallel)] if parallel is not None else []),
            *(["--ctx", str(ctx)] if ctx is not None else []), *args,
        ]
        self.model = model
        self.port = None
        self.lines = []
        self._port_seen = threading.Event()
        env = {**{k: v for k, v in os.environ.items() if k not in ("LEAP_API_KEY", "LLAMA_API_KEY")},
               **(env or {})}
        self.proc = subprocess.Popen(
            self.cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, errors="replace",
        )
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            m = LISTENING.search(line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._port_seen.set()
        self._port_seen.set()

    def stderr(self):
        return "\n".join(self.lines[-60:])

    def wait_line(self, needle, timeout):
        """Wait until stderr has a line containing `needle`."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(needle in l for l in self.lines):
                return True
            time.sleep(0.05)
        return False

    def _wait_ready(self):
        t0 = time.monotonic()
        self._port_seen.wait(READY_TIMEOUT)
        assert self.port, f"{' '.join(self.cmd)}: no `listening on` line\n{self.stderr()}"
        seen = []
        while time.monotonic() - t0 < READY_TIMEOUT:
            assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.stderr()}"
            try:
                status, _, body = request(self.port, "GET", "/health", timeout=5)
            except OSError:
                status, body = None, b""
            if status is not None:
                seen.append(status)
                assert status in (200, 503), f"/health answered {status}: {body!r}"
                if status == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"not ready in {READY_TIMEOUT} s (health: {seen[-5:]}):\n{self.stderr()}")

    def terminate(self, timeout=STOP_TIMEOUT):
        """SIGTERM, then the exit code (None if it did not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(5)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop_and_check(self):
        rc = self.terminate()
        if rc is None:
            self.kill()
        assert rc == 0, f"`leap serve` exited with {rc} on SIGTERM:\n{self.stderr()}"
        # Nothing was left running: the slots were joined and the model freed.
        assert "not waiting for a tokenization" not in self.stderr(), self.stderr()


def request(port, method, path, body=None, headers=None, timeout=HTTP_TIMEOUT):
    """One HTTP request to 127.0.0.1:port: (status, headers, body bytes)."""
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        h = {"Content-Type": "application/json"} if body is not None else {}
        h.update(headers or {})
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def post(port, path, body, headers=None, timeout=HTTP_TIMEOUT):
    """POST JSON; (status, parsed JSON body)."""
    status, _, raw = request(port, "POST", path, body, headers, timeout)
    try:
        return status, json.loads(raw)
    except ValueError:
        raise AssertionError(f"POST {path}: {status} with a body that is not JSON: {raw[:300]!r}")


def open_stream(port, path, body, timeout=HTTP_TIMEOUT):
    """Start a streamed request: (connection, response), status 200 and SSE checked."""
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    c.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raw = r.read()
        c.close()
        raise AssertionError(f"POST {path} (stream): {r.status} {raw[:300]!r}")
    assert r.getheader("Content-Type", "").startswith("text/event-stream"), r.getheaders()
    return c, r


def complete(port, prompt, n=16, timeout=HTTP_TIMEOUT, headers=None, **kw):
    """A greedy completion over raw HTTP: the response's JSON, status 200 checked."""
    status, j = post(port, "/v1/completions",
                     {"prompt": prompt, "max_tokens": n, "temperature": 0, **kw}, headers, timeout)
    assert status == 200, j
    return j


def metrics(port):
    """GET /metrics: each sample's value by name."""
    status, _, raw = request(port, "GET", "/metrics", timeout=10)
    assert status == 200, raw
    out = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def assert_error(status, j, want_status, param=None, code=None):
    """An OpenAI-shaped error body with this status (and param, code when given)."""
    assert status == want_status, (status, j)
    err = j.get("error")
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], j
    assert isinstance(err.get("type"), str), j
    if want_status == 400:
        assert err["type"] == "invalid_request_error", j
    if param is not None:
        assert err.get("param") == param, j
    if code is not None:
        assert err.get("code") == code, j


@pytest.fixture(scope="session")
def server(leap, smollm):
    """The server most tests share: SmolLM2, 4 slots of 1024 tokens, a thread each."""
    s = Server(leap, smollm, ctx=1024, parallel=4, threads=1)
    yield s
    s.stop_and_check()


@pytest.fixture(scope="module")
def server1(leap, smollm):
    """One slot: a request that is not cancelled blocks the next."""
    s = Server(leap, smollm, ctx=1024, parallel=1, threads=1)
    yield s
    s.stop_and_check()


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama.cpp llama-server (stock, or built with Leap by `make llama`) as a subprocess on a
    free port of 127.0.0.1, ready when started; `stop()` sends SIGTERM and returns its stderr.
    `maps` is /proc/PID/maps once it is ready (which libraries it loaded)."""

    def __init__(self, bin_dir, model, extra=(), env=None, ctx=2048):
        self.port = free_port()
        cmd = [str(Path(bin_dir) / "llama-server"), "-m", model, "--host", HOST, "--port",
               str(self.port), "-t", "2", "-np", "1", "-c", str(ctx), *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.time() + READY_TIMEOUT
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"llama-server exited: {self.proc.stderr.read().decode()[-3000:]}")
                try:
                    status, _, _ = request(self.port, "GET", "/health", timeout=5)
                    if status == 200:
                        break
                except OSError:
                    pass
                assert time.time() < deadline, "llama-server did not get ready"
                time.sleep(0.5)
            self.maps = Path(f"/proc/{self.proc.pid}/maps").read_text()
        except BaseException:
            self.proc.kill()
            self.proc.communicate()
            raise

    def complete(self, prompt, max_tokens=24, **extra):
        """A non-streamed /v1/completions answer (greedy unless `extra` says otherwise)."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "cache_prompt": False, **extra}
        status, _, r = request(self.port, "POST", "/v1/completions", body)
        assert status == 200, r
        return json.loads(r)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err.decode(errors="replace")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.stop()
