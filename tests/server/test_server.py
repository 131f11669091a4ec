"""`leap serve` end to end: llama-server's OpenAI-compatible API as clients see it, through the
real `openai` package and through raw HTTP (for exact statuses and bodies).

Greedy outputs are compared with `leap generate --mode plain` and with each other (streamed or
not, alone or beside other requests), so a request's tokens must not depend on how it is
served. Generations are short (16-32 tokens) to keep the suite quick on a shared machine."""

import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import (HOST, HTTP_TIMEOUT, LlamaServer, Server, assert_error, complete, metrics,
                      open_stream, post, request)

PROMPT = "The capital of France is"
PROMPTS = [
    PROMPT,
    "def fibonacci(n):",
    "Here is a list of fruits:",
    "The quick brown fox",
]
CHAT = [{"role": "user", "content": "Name three colors."}]


# --- helpers -----------------------------------------------------------------------------------


def read_sse(resp):
    """The data events of a server-sent-event response: parsed JSON objects, then "[DONE]"."""
    events = []
    for line in iter(resp.readline, b""):
        line = line.rstrip(b"\r\n")
        if not line.startswith(b"data:"):
            continue
        data = line[5:].lstrip(b" ")
        if data == b"[DONE]":
            events.append("[DONE]")
            break
        events.append(json.loads(data))
    return events


def stream(port, path, body, timeout=HTTP_TIMEOUT):
    c, r = open_stream(port, path, body, timeout)
    try:
        return read_sse(r)
    finally:
        c.close()


def stream_text(events):
    """The concatenated text of a completions stream, and its finish reason."""
    assert events and events[-1] == "[DONE]", f"no [DONE]: {events[-3:]}"
    choices = [e["choices"][0] for e in events[:-1] if isinstance(e, dict) and e.get("choices")]
    assert choices, events
    text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
    return text, choices[-1]["finish_reason"]


_generated = {}


def leap_generate(leap, model, prompt, n):
    """`leap generate --mode plain`'s text (stdout less its one trailing newline)."""
    key = (model, prompt, n)
    if key not in _generated:
        r = subprocess.run(
            [leap, "generate", "-m", model, "--mode", "plain", "-p", prompt, "-n", str(n), "-t", "1"],
            capture_output=True, timeout=180,
        )
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        out = r.stdout.decode()
        assert out.endswith("\n"), repr(out)
        _generated[key] = out[:-1]
    return _generated[key]


@pytest.fixture(scope="module")
def model_id(server):
    status, _, raw = request(server.port, "GET", "/v1/models")
    assert status == 200
    return json.loads(raw)["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{HOST}:{server.port}/v1", api_key="none",
                         timeout=HTTP_TIMEOUT, max_retries=0)


# --- 1. health and models ----------------------------------------------------------------------


def test_health_and_models(server):
    status, _, raw = request(server.port, "GET", "/health")
    assert status == 200 and json.loads(raw) == {"status": "ok"}
    status, _, raw = request(server.port, "GET", "/v1/models")
    assert status == 200
    j = json.loads(raw)
    assert j["object"] == "list" and len(j["data"]) == 1, j
    assert isinstance(j["data"][0]["id"], str) and j["data"][0]["id"], j


# --- 2, 3. the openai package: completions and chat, streamed or not -------------------------------


def test_completion_matches_leap_generate(server, client, model_id, leap, smollm):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0)
    want = leap_generate(leap, smollm, PROMPT, 24)
    choice = r.choices[0]
    assert choice.text == want
    assert r.usage.prompt_tokens > 0
    assert r.usage.completion_tokens == 24 or choice.finish_reason == "stop", r
    assert choice.finish_reason == ("length" if r.usage.completion_tokens == 24 else "stop")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_matches(server, client, model_id):
    kw = dict(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert len(texts) > 2, "the text came in one piece: not streamed"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1]), finishes
    last = chunks[-1]
    assert not last.choices and last.usage is not None, last
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_matches(server, client, model_id):
    kw = dict(model=model_id, messages=CHAT, max_tokens=32, temperature=0)
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content, whole
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.object == "chat.completion"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


# --- 4. client mistakes: exact statuses and error objects ----------------------------------------

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body, param, code",
    [
        ("/v1/completions", b'{"prompt": "x", ', None, None),
        ("/v1/completions", b"[1, 2]", None, None),
        ("/v1/completions", {"max_tokens": 4}, "prompt", None),
        ("/v1/completions", {"prompt": 5}, None, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, None, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", None),
        ("/v1/completions", {"prompt": "x", "temperature": 9}, "temperature", None),
        ("/v1/completions", {"prompt": "x", "n": 2}, "n", None),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, None, "context_length_exceeded"),
        ("/v1/completions", {"prompt": "x " * 1100, "max_tokens": 4}, None, "context_length_exceeded"),
        ("/v1/completions", {"prompt": [], "max_tokens": 4}, "prompt", None),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]", None),
        ("/v1/chat/completions", {"messages": []}, "messages", None),
        ("/v1/chat/completions", {"messages": "hi"}, None, None),
        # No field dropped in silence (server/src/fields.rs): what this server would not apply
        # is a 400 naming it, not a 200 with a different answer.
        ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "xml"}},
         "response_format", None),
        ("/v1/completions", {"prompt": "x", "tools": [{"type": "function",
                             "function": {"name": "f", "parameters": {}}}]}, "tools", None),
        ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs", None),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", None),
        ("/v1/completions", {"prompt": "x", "grammar": 'root ::= ('}, "grammar", None),
        ("/v1/completions", {"prompt": "x", "json_schema": {"type": "object", "properties": 3}},
         "json_schema", None),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", None),
        ("/v1/completions", {"prompt": "x", "max_token": 4}, "max_token", None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]},
         "messages[0].audio", None),
        ("/v1/chat/completions", {"messages": HI + [{"role": "assistant", "content": None,
                                  "tool_calls": [{"id": "1", "type": "function"}]}]},
         "messages[1]", None),
        ("/tokenize", {"content": "x", "add_bos": True}, "add_bos", None),
    ],
    ids=[
        "malformed-json", "not-an-object", "missing-prompt", "prompt-int", "max_tokens-string",
        "max_tokens-0", "temperature-9", "n-2", "five-stops", "max_tokens-beyond-ctx",
        "prompt-beyond-ctx", "empty-prompt", "chat-unknown-role", "chat-no-messages",
        "chat-messages-string", "unknown-format", "tools-on-completions",
        "top_logprobs-without-logprobs", "logprobs-21", "bad-grammar", "bad-schema", "penalty",
        "misspelt-field", "message-audio", "tool-call-without-name", "tokenize-unknown-field",
    ],
)
def test_bad_request(server, path, body, param, code):
    status, j = post(server.port, path, body)
    assert_error(status, j, 400, param=param, code=code)


def test_logprobs(server):
    """`logprobs` (chat: with `top_logprobs`; completions: a count) gives each emitted token's
    log-probability in OpenAI's shapes; greedy, each token is its position's most likely, and
    the tokens spell the text (Session::score's tests check the numbers are plain
    decoding's)."""
    status, j = post(server.port, "/v1/chat/completions",
                     {"messages": HI, "max_tokens": 8, "temperature": 0, "logprobs": True,
                      "top_logprobs": 3})
    assert status == 200, j
    choice = j["choices"][0]
    content = choice["logprobs"]["content"]
    assert 1 <= len(content) <= j["usage"]["completion_tokens"]
    assert "".join(c["token"] for c in content).startswith(choice["message"]["content"])
    for c in content:
        assert c["logprob"] <= 0 and len(c["top_logprobs"]) == 3, c
        assert c["top_logprobs"][0]["token"] == c["token"], c
        assert c["top_logprobs"][0]["logprob"] == c["logprob"], c
        assert bytes(c["bytes"]).decode("utf-8", "replace") == c["token"]
    j = complete(server.port, "The capital of France is", 6, logprobs=2)
    lp = j["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == j["choices"][0]["text"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"])
    assert all(len(t) <= 2 and max(t.values()) == v
               for t, v in zip(lp["top_logprobs"], lp["token_logprobs"])), lp
    assert lp["text_offset"][0] == 0
    # Without asking, none.
    assert complete(server.port, "The capital of France is", 2)["choices"][0]["logprobs"] is None


def test_structured_output(server):
    """Structured output through the openai package: `response_format` with a JSON schema gives
    JSON of that schema (streamed too, the same text), `json_object` a JSON object, and
    llama-server's `grammar` holds a completion to its words."""
    client = openai.OpenAI(base_url=f"http://{HOST}:{server.port}/v1", api_key="none",
                           timeout=HTTP_TIMEOUT, max_retries=0)
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon"]}, "rank": {"type": "integer"}},
        "required": ["city", "rank"], "additionalProperties": False}
    ask = dict(model="m", max_tokens=48, temperature=0,
               messages=[{"role": "user", "content": "Name the largest city of France as JSON."}],
               response_format={"type": "json_schema",
                                "json_schema": {"name": "city", "schema": schema, "strict": True}})
    r = client.chat.completions.create(**ask)
    doc = json.loads(r.choices[0].message.content)
    assert set(doc) == {"city", "rank"} and doc["city"] in ("Paris", "Lyon"), doc
    assert isinstance(doc["rank"], int) and r.choices[0].finish_reason == "stop", r
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **ask) if c.choices)
    assert streamed == r.choices[0].message.content
    # Any object: it may run past max_tokens, but it is one from its first character.
    r = client.chat.completions.create(**{**ask, "response_format": {"type": "json_object"}})
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{"), text
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict), text
    status, j = post(server.port, "/v1/completions",
                     {"prompt": "Is Paris in France? Answer:", "max_tokens": 8, "temperature": 0,
                      "grammar": 'root ::= " yes" | " no"'})
    assert status == 200 and j["choices"][0]["text"] in (" yes", " no"), j


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather now in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time now in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                       "required": ["zone"], "additionalProperties": False}}},
]


def test_tool_calls(server):
    """Tool calling through the openai package: a required call parses to a given function and
    its arguments' schema, streamed the same (deltas as OpenAI streams a call), a named function
    is the one called; the call and its result go back as messages for the next turn; without a
    call the answer is text; what cannot be honoured is a 400 naming the field."""
    client = openai.OpenAI(base_url=f"http://{HOST}:{server.port}/v1", api_key="none",
                           timeout=HTTP_TIMEOUT, max_retries=0)
    ask = dict(model="m", max_tokens=64, temperature=0, tools=TOOLS, tool_choice="required",
               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    r = client.chat.completions.create(**ask)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, r
    call = c.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    want_key = {"get_weather": "city", "get_time": "zone"}[call.function.name]
    assert set(args) == {want_key} and isinstance(args[want_key], str), args
    assert call.type == "function" and call.id
    # Streamed: the openai package's deltas, gathered, are the same calls.
    names, arguments, finish = {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **ask):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or []:
            names[d.index] = names.get(d.index, "") + (d.function.name or "")
            arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
        finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert [(names[i], arguments[i]) for i in sorted(names)] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    # A named function, one call.
    r = client.chat.completions.create(**{
        **ask, "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time", r
    assert set(json.loads(calls[0].function.arguments)) == {"zone"}
    # The next turn: the call and its result as messages; "none" answers in text.
    turn = ask["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'}]
    r = client.chat.completions.create(**{**ask, "messages": turn, "tool_choice": "none"})
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls, r
    # "auto": a call or a text answer, either parsed.
    r = client.chat.completions.create(**{**ask, "messages": turn, "tool_choice": "auto"})
    m = r.choices[0].message
    assert (m.tool_calls and r.choices[0].finish_reason == "tool_calls") or \
        (m.content is not None and not m.content.lstrip().startswith('{"response"')), r
    for body, param in [
        ({**ask, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice"),
        ({**ask, "response_format": {"type": "json_object"}}, "response_format"),
        ({**ask, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": 3}}}]}, "tools"),
    ]:
        body.pop("model")
        status, j = post(server.port, "/v1/chat/completions", body)
        assert_error(status, j, 400, param)


def test_embeddings(leap, smollm, stock_bin, server):
    """/v1/embeddings with --embeddings, through the openai package (which asks for base64) and
    as floats: unit vectors of the model's width, llama.cpp's own (a stock llama-server with
    --embeddings --pooling mean) up to kernel rounding, a paraphrase nearer than another topic.
    Without --embeddings, llama-server's 501."""
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.",
             "Quarterly revenue rose by four percent."]
    cos = lambda u, v: sum(p * q for p, q in zip(u, v)) / math.sqrt(
        sum(p * p for p in u) * sum(q * q for q in v))
    status, j = post(server.port, "/v1/embeddings", {"input": "x"})
    assert status == 501 and "--embeddings" in j["error"]["message"], j
    s = Server(leap, smollm, "--embeddings", ctx=512)
    stock = LlamaServer(stock_bin, smollm, ["--embeddings", "--pooling", "mean"], ctx=512)
    try:
        client = openai.OpenAI(base_url=f"http://{HOST}:{s.port}/v1", api_key="none",
                               timeout=HTTP_TIMEOUT, max_retries=0)
        r = client.embeddings.create(model="m", input=texts)
        got = [d.embedding for d in r.data]
        assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens > 0
        status, j = post(s.port, "/v1/embeddings", {"input": texts, "encoding_format": "float"})
        assert status == 200 and [d["embedding"] for d in j["data"]] == got, j
        status, _, body = request(stock.port, "POST", "/v1/embeddings",
                                  {"input": texts, "encoding_format": "float"})
        assert status == 200, body
        want = [d["embedding"] for d in json.loads(body)["data"]]
        for g, w in zip(got, want):
            assert len(g) == len(w) == 576
            assert abs(math.sqrt(sum(x * x for x in g)) - 1) < 1e-4
            assert cos(g, w) > 0.995, cos(g, w)
        assert cos(got[0], got[1]) > cos(got[0], got[2])
        # Token ids, llama-server's `content`, and what is refused by name.
        ids = json.loads(request(s.port, "POST", "/tokenize",
                                 {"content": texts[0], "add_special": True})[2])["tokens"]
        status, j = post(s.port, "/embeddings", {"content": [ids], "encoding_format": "float"})
        assert status == 200 and j["data"][0]["embedding"] == got[0], j
        for body, param in [({"input": texts, "dimensions": 8}, "dimensions"),
                            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                            ({"input": []}, "input"), ({"input": "x", "pooling": "max"}, None)]:
            status, j = post(s.port, "/v1/embeddings", body)
            assert_error(status, j, 400, param)
    finally:
        stock.stop()
        s.stop_and_check()


def test_streamed_logprobs_are_the_unstreamed_ones(server):
    """Streamed, the logprobs come with the last chunk (they are computed in one pass after the
    output): the openai package gathers them, and they are the unstreamed request's."""
    client = openai.OpenAI(base_url=f"http://{HOST}:{server.port}/v1", api_key="none",
                           timeout=HTTP_TIMEOUT, max_retries=0)
    ask = dict(model="m", messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**ask)
    text, gathered = "", []
    for chunk in client.chat.completions.create(stream=True, **ask):
        c = chunk.choices[0] if chunk.choices else None
        if c and c.delta and c.delta.content:
            text += c.delta.content
        if c and c.logprobs and c.logprobs.content:
            gathered += c.logprobs.content
    assert text == whole.choices[0].message.content
    assert [(t.token, t.logprob) for t in gathered] == \
        [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]
    assert all(len(t.top_logprobs) == 2 for t in gathered)
    # The completions API's shape, streamed.
    events = stream(server.port, "/v1/completions",
                    {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                     "logprobs": 2})
    lps = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"][0].get("logprobs")]
    assert len(lps) == 1, events
    want = complete(server.port, "The capital of France is", 6, logprobs=2)["choices"][0]["logprobs"]
    assert lps[0] == want


def test_llama_server_s_completion_endpoint(server):
    """llama-server's own `/completion`: its request (`n_predict`, `return_tokens`) and its
    answer (`content`, `tokens`, `stop`, `stop_type`, `timings`), streamed in its shape too
    (objects with `content` and `stop`, the last with the counts, no `[DONE]`); the text is
    /v1/completions' for the same request."""
    want = complete(server.port, PROMPT, 12)["choices"][0]["text"]
    status, j = post(server.port, "/completion", {"prompt": PROMPT, "n_predict": 12,
                                                  "temperature": 0, "return_tokens": True})
    assert status == 200, j
    assert j["content"] == want and j["stop"] is True, j
    assert j["stop_type"] in ("limit", "eos") and j["tokens_predicted"] >= len(j["tokens"]) >= 1, j
    assert j["timings"]["predicted_n"] == j["tokens_predicted"], j
    status, d = post(server.port, "/detokenize", {"tokens": j["tokens"]})
    assert status == 200 and d["content"] == want, d
    c, r = open_stream(server.port, "/completion",
                       {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "stream": True})
    try:
        events = [json.loads(line[5:]) for line in iter(r.readline, b"") if line.startswith(b"data:")]
    finally:
        c.close()
    assert events and events[-1]["stop"] is True and "timings" in events[-1], events[-1]
    assert all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == want
    status, j = post(server.port, "/completion", {"prompt": PROMPT, "stream": True, "return_tokens": True})
    assert_error(status, j, 400, param="return_tokens")
    # `id_slot`: the slot it names runs it; one the server does not have is a 400.
    slots = json.loads(request(server.port, "GET", "/props")[2])["total_slots"]
    status, j = post(server.port, "/completion", {"prompt": PROMPT, "n_predict": 12,
                                                  "temperature": 0, "id_slot": slots - 1})
    assert status == 200 and j["id_slot"] == slots - 1 and j["content"] == want, j
    for slot in (slots, -2):
        status, j = post(server.port, "/completion", {"prompt": PROMPT, "id_slot": slot})
        assert_error(status, j, 400, param="id_slot")


def test_n_probs_on_llama_server_s_completion(server):
    """`n_probs` on `/completion`: llama-server's `completion_probabilities` (each token's id,
    text, bytes and logprob, and the most likely at its position), the same figures as
    /v1/completions' logprobs; absent when not asked; out of range, a 400."""
    status, j = post(server.port, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0,
                                                  "n_probs": 2, "return_tokens": True})
    assert status == 200, j
    probs = j["completion_probabilities"]
    assert [p["id"] for p in probs] == j["tokens"][:len(probs)] and probs, j
    for p in probs:
        assert len(p["top_logprobs"]) == 2 and p["top_logprobs"][0]["id"] == p["id"], p
        assert p["top_logprobs"][0]["logprob"] == p["logprob"] <= 0, p
        assert bytes(p["bytes"]).decode("utf-8", "replace") == p["token"], p
    want = complete(server.port, PROMPT, 6, logprobs=2)["choices"][0]["logprobs"]
    assert [p["logprob"] for p in probs] == want["token_logprobs"]
    assert "completion_probabilities" not in post(server.port, "/completion",
                                                  {"prompt": PROMPT, "n_predict": 2})[1]
    status, j = post(server.port, "/completion", {"prompt": PROMPT, "n_probs": 21})
    assert_error(status, j, 400, param="n_probs")


def test_neutral_fields_change_nothing(server):
    """What SDKs and llama.cpp's web UI send at their defaults (every extra sampler off, no
    tools, text output, the model's name) is accepted and leaves the answer as it is."""
    neutral = {"model": "whatever", "presence_penalty": 0, "frequency_penalty": 0,
               "repeat_penalty": 1.0, "typical_p": 1.0, "dry_multiplier": 0, "xtc_probability": 0,
               "mirostat": 0, "samplers": "edkypmxt", "logit_bias": {}, "logprobs": None,
               "n_probs": 0, "id_slot": -1, "user": "u1", "best_of": 1}
    prompt = "The capital of France is"
    plain = complete(server.port, prompt, 8)
    assert complete(server.port, prompt, 8, **neutral)["choices"][0]["text"] == \
        plain["choices"][0]["text"]
    status, j = post(server.port, "/v1/chat/completions",
                     {"messages": HI, "max_tokens": 4, "tools": [], "tool_choice": "auto",
                      "response_format": {"type": "text"}, "logprobs": False})
    assert status == 200, j


def test_body_too_large(server):
    body = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    c = http.client.HTTPConnection(HOST, server.port, timeout=HTTP_TIMEOUT)
    try:
        try:
            c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered before reading it all: the answer is still there to read
        r = c.getresponse()
        status, raw = r.status, r.read()
    finally:
        c.close()
    assert_error(status, json.loads(raw), 413)


def test_unknown_route(server):
    status, _, raw = request(server.port, "GET", "/nope")
    assert_error(status, json.loads(raw), 404)


def test_tokenize_detokenize(server):
    status, j = post(server.port, "/tokenize", {"content": "hello world"})
    assert status == 200, j
    toks = j["tokens"]
    assert toks and all(isinstance(t, int) for t in toks), j
    status, j = post(server.port, "/detokenize", {"tokens": toks})
    assert status == 200, j
    assert j["content"].lstrip(" ") == "hello world", j
    status, j = post(server.port, "/detokenize", {"tokens": [999999999]})
    assert_error(status, j, 400, param="tokens")
    status, j = post(server.port, "/tokenize", {"text": "no content field"})
    assert_error(status, j, 400, param="text")  # not one of /tokenize's fields
    status, j = post(server.port, "/tokenize", {})
    assert_error(status, j, 400, param="content")


def test_still_serving_after_errors(server):
    j = complete(server.port, PROMPT, 8)
    assert j["choices"][0]["text"] and j["usage"]["completion_tokens"] >= 1
    status, _, _ = request(server.port, "GET", "/health")
    assert status == 200


# --- 5. stop strings --------------------------------------------------------------------------------


def test_stop_string(server, client, model_id):
    full = complete(server.port, PROMPT, 24)["choices"][0]["text"]
    words = full.split()
    assert len(words) >= 3, repr(full)
    # The second word, and a string across two tokens (a word's end and the next one's start).
    w2, w3 = words[1], words[2]
    i3 = full.index(w3, full.index(w2) + len(w2))
    across = full[i3 - 2:i3 + 2] if i3 >= 2 else w3
    for stop in (w2, across):
        want = full[: full.index(stop)]
        j = complete(server.port, PROMPT, 24, stop=stop)
        assert j["choices"][0]["text"] == want, (stop, full)
        assert j["choices"][0]["finish_reason"] == "stop"
        assert j["usage"]["completion_tokens"] < 24
        text, finish = stream_text(stream(server.port, "/v1/completions",
                                          {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": [stop]}))
        assert (text, finish) == (want, "stop"), (stop, full)


# --- 6. sampling -------------------------------------------------------------------------------------


def test_sampling(server, client, model_id):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0.8, seed=7)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 16
    assert r.choices[0].text or r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0


# --- 7. concurrency -------------------------------------------------------------------------------


def test_concurrent_requests(server):
    alone = {p: complete(server.port, p, 16)["choices"][0]["text"] for p in PROMPTS}

    def one(i, k):
        p = PROMPTS[(i + k) % len(PROMPTS)]
        body = {"prompt": p, "max_tokens": 16, "temperature": 0}
        if (i + k) % 2:
            text, finish = stream_text(stream(server.port, "/v1/completions", body))
        else:
            j = complete(server.port, p, 16)
            text, finish = j["choices"][0]["text"], j["choices"][0]["finish_reason"]
        assert finish in ("stop", "length")
        return p, text

    def client_thread(i):
        return [one(i, k) for k in range(3)]

    with ThreadPoolExecutor(8) as ex:
        results = [r for f in [ex.submit(client_thread, i) for i in range(8)] for r in f.result(timeout=240)]
    assert len(results) == 24
    for p, text in results:
        assert text == alone[p], p

    # Four greedy streams at once, one per slot: each as when it was alone.
    barrier = threading.Barrier(4, timeout=30)

    def streamed(p):
        barrier.wait()
        return stream_text(stream(server.port, "/v1/completions", {"prompt": p, "max_tokens": 16, "temperature": 0}))[0]

    with ThreadPoolExecutor(4) as ex:
        texts = list(ex.map(streamed, PROMPTS, timeout=120))
    assert texts == [alone[p] for p in PROMPTS]


# --- 10. metrics -------------------------------------------------------------------------------------


def test_metrics(server):
    status, headers, raw = request(server.port, "GET", "/metrics")
    assert status == 200 and headers.get("content-type", "").startswith("text/plain")
    text = raw.decode()
    for name in ["leap:requests_total", "leap:tokens_predicted_total", "leap:target_calls_total",
                 "leap:accepted_tokens_per_call"]:
        assert re.search(rf"^{re.escape(name)} [0-9.e+-]+$", text, re.M), (name, text)
    before = metrics(server.port)
    j = complete(server.port, PROMPT, 8)
    after = metrics(server.port)
    assert after["leap:requests_total"] == before["leap:requests_total"] + 1
    assert after["leap:tokens_predicted_total"] == before["leap:tokens_predicted_total"] + j["usage"]["completion_tokens"]
    assert after["leap:target_calls_total"] > before["leap:target_calls_total"]
    assert after["leap:accepted_tokens_per_call"] >= 1
    assert after["leap:requests_processing"] == 0


# --- 8. a client that hangs up frees its slot --------------------------------------------------------


def test_client_hangup_frees_slot(server1):
    port = server1.port
    # Greedy, so it is known to run its 1000 tokens (no end-of-generation before; ~10 s here).
    long_req = {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0}
    before = metrics(port)
    c, r = open_stream(port, "/v1/completions", long_req)
    # Read 60 tokens (a chunk each), timing the last 50: how long the rest would take.
    marks = []
    for line in iter(r.readline, b""):
        if line.startswith(b"data:"):
            marks.append(time.monotonic())
            if len(marks) == 60:
                break
    assert len(marks) == 60 and b'"finish_reason":null' in line, line
    rest_s = (1000 - 60) * (marks[-1] - marks[10]) / 49  # if the request kept its slot
    bound = min(20.0, rest_s / 3)
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()

    # One slot: the next request runs only once the hung-up one is stopped.
    t0 = time.monotonic()
    j = complete(port, PROMPT, 8, timeout=bound + 5)
    took = time.monotonic() - t0
    assert took < bound, f"{took:.1f} s for 8 tokens (the hung-up request would need {rest_s:.1f} s more)"
    after = metrics(port)
    assert after["leap:requests_cancelled_total"] >= before["leap:requests_cancelled_total"] + 1
    # Only the small request finished: the hung-up one was not run to its end.
    assert after["leap:requests_total"] == before["leap:requests_total"] + 1
    assert after["leap:tokens_predicted_total"] == before["leap:tokens_predicted_total"] + j["usage"]["completion_tokens"]
    assert after["leap:requests_processing"] == 0


def test_cache_prompt(server1, leap, smollm):
    """With --shared-cache a slot's kept prompt is reused (usage's cached_tokens, timings'
    cache_n), and `cache_prompt: false` (llama-server's switch) prefills the whole prompt;
    without it (the default: each request its own tenant) nothing is kept. The text is the same."""
    prompt = "A slot keeps the prompt it decoded last, so asking again costs little:"
    s = Server(leap, smollm, "--shared-cache", ctx=1024, parallel=1, threads=1)
    try:
        first = complete(s.port, prompt, 8)
        again = complete(s.port, prompt, 8)
        n = again["usage"]["prompt_tokens"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1, again["usage"]
        assert again["timings"]["cache_n"] == n - 1 and again["timings"]["prompt_n"] == 1, again["timings"]
        fresh = complete(s.port, prompt, 8, cache_prompt=False)
        assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, fresh["usage"]
        assert fresh["timings"]["prompt_n"] == n, fresh["timings"]
    finally:
        s.stop_and_check()
    complete(server1.port, prompt, 8)
    alone = complete(server1.port, prompt, 8)
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, alone["usage"]
    texts = [r["choices"][0]["text"] for r in (first, again, fresh, alone)]
    assert len(set(texts)) == 1, texts


def test_no_threads_outlive_their_requests(leap, smollm):
    """Requests on several slots leave no threads behind: a session lets the OpenMP team ggml
    made on its thread go when a generation ends. Slot threads used to keep their teams, and
    with more OpenMP threads alive than CPUs libgomp all but stops spinning, so after one
    burst of concurrent requests every later request decoded 3-4x slower."""
    s = Server(leap, smollm, ctx=1024, parallel=4, threads=2)
    try:
        def tasks():
            """Threads named for slots: OpenMP's workers take the name of the thread that
            made them (tokio's blocking threads, which idle for 10 s, are not counted)."""
            n = 0
            for t in os.listdir(f"/proc/{s.proc.pid}/task"):
                try:
                    with open(f"/proc/{s.proc.pid}/task/{t}/comm") as f:
                        n += f.read().startswith("leap-slot")
                except OSError:
                    pass  # ended meanwhile
            return n

        with ThreadPoolExecutor(4) as ex:
            for j in ex.map(lambda p: complete(s.port, p, 8), PROMPTS):
                assert j["choices"][0]["text"]
        # The four slots' own threads (a team goes just after its request's answer).
        deadline = time.monotonic() + 10
        while tasks() > 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tasks() == 4, f"{tasks()} slot threads after four concurrent requests on four slots"
    finally:
        s.stop_and_check()


# --- 9. API key --------------------------------------------------------------------------------------


def test_api_key(leap, smollm):
    s = Server(leap, smollm, "--api-key", "sekrit", ctx=256, parallel=1)
    try:
        for path in ("/health", "/v1/health"):
            status, _, raw = request(s.port, "GET", path)
            assert status == 200, raw
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            status, _, raw = request(s.port, "GET", "/v1/models", headers=headers)
            assert_error(status, json.loads(raw), 401, code="invalid_api_key")
        status, j = post(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert_error(status, j, 401, code="invalid_api_key")
        status, _, raw = request(s.port, "GET", "/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert status == 200 and json.loads(raw)["data"], raw
        base = f"http://{HOST}:{s.port}/v1"
        ok = openai.OpenAI(base_url=base, api_key="sekrit", timeout=HTTP_TIMEOUT, max_retries=0)
        mid = ok.models.list().data[0].id
        r = ok.completions.create(model=mid, prompt=PROMPT, max_tokens=4, temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens >= 1
        bad = openai.OpenAI(base_url=base, api_key="nope", timeout=HTTP_TIMEOUT, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        s.stop_and_check()


def test_cors_and_llama_server_s_key_names(leap, smollm):
    """A browser front end (a page on localhost) gets its preflight answered before the
    API-key check and CORS headers on the answer; the key may come as llama-server's
    `X-Api-Key` header and from its LLAMA_API_KEY variable."""
    s = Server(leap, smollm, ctx=256, parallel=1, env={"LLAMA_API_KEY": "sekrit"})
    try:
        origin = {"Origin": "http://localhost:5173"}
        status, h, raw = request(s.port, "OPTIONS", "/v1/chat/completions", headers={
            **origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert status in (200, 204), (status, raw)
        h = {k.lower(): v for k, v in h.items()}
        assert h.get("access-control-allow-origin") == "*", h
        assert "POST" in h.get("access-control-allow-methods", ""), h
        assert "authorization" in h.get("access-control-allow-headers", "").lower(), h
        status, _, raw = request(s.port, "GET", "/v1/models", headers=origin)
        assert_error(status, json.loads(raw), 401, code="invalid_api_key")
        status, h, raw = request(s.port, "GET", "/v1/models", headers={**origin, "X-Api-Key": "sekrit"})
        assert status == 200 and json.loads(raw)["data"], raw
        assert {k.lower(): v for k, v in h.items()}.get("access-control-allow-origin") == "*", h
        # A page of another host is still refused on loopback (DNS rebinding), preflight too.
        status, _, _ = request(s.port, "OPTIONS", "/v1/models", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "GET"})
        assert status == 403
    finally:
        s.stop_and_check()


def test_llama_server_s_flags(leap, smollm):
    """llama-server's command line works: `-c` is the context of all slots together (each of
    `-np 2` gets half), `-s` seeds the requests that send no seed, `--metrics` is taken (its
    names under `llamacpp:` too), `--chat-template` replaces the GGUF's;
    `/props` and `/slots` say so."""
    s = Server(leap, smollm, "-c", "512", "-np", "2", "-s", "7", "--metrics", "--chat-template",
               "llama3", ctx=None, parallel=None)
    try:
        status, j = post(s.port, "/v1/completions", {"prompt": "x " * 300, "max_tokens": 4})
        assert_error(status, j, 400, code="context_length_exceeded")
        assert "256" in j["error"]["message"], j
        body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}
        texts = [complete(s.port, **body, n=12)["choices"][0]["text"] for _ in range(2)]
        seeded = complete(s.port, **body, n=12, seed=7)["choices"][0]["text"]
        assert texts == [seeded, seeded], (texts, seeded)
        status, _, raw = request(s.port, "GET", "/metrics")
        assert status == 200 and b"llamacpp:tokens_predicted_total" in raw, raw
        status, _, raw = request(s.port, "GET", "/props")
        props = json.loads(raw)
        assert status == 200 and props["total_slots"] == 2, props
        assert props["default_generation_settings"]["n_ctx"] == 256, props
        assert props["default_generation_settings"]["params"]["seed"] == 7, props
        assert props["model_path"].endswith(".gguf") and props["chat_template"] == "llama3", props
        # --chat-template: llama3's format, not the GGUF's ChatML.
        status, j = post(s.port, "/apply-template", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and "<|start_header_id|>user<|end_header_id|>" in j["prompt"], j
        # /slots: two, idle, one holding the last request's tokens; none busy, so
        # fail_on_no_slot is no failure. (A slot turns idle just after its answer is sent.)
        for _ in range(100):
            status, _, raw = request(s.port, "GET", "/slots?fail_on_no_slot=1")
            slots = json.loads(raw)
            if status == 200 and not any(x["is_processing"] for x in slots):
                break
            time.sleep(0.02)
        assert status == 200 and [x["id"] for x in slots] == [0, 1], slots
        assert all(x["n_ctx"] == 256 and x["is_processing"] is False and x["speculative"]
                   for x in slots), slots
        assert max(x["tokens_cached"] for x in slots) > 12, slots
        assert "prompt" not in slots[0], slots
    finally:
        s.stop_and_check()


# --- 11. SIGTERM finishes the requests in flight ---------------------------------------------------


def test_sigterm_finishes_in_flight(leap, smollm):
    s = Server(leap, smollm, ctx=512, parallel=1)
    try:
        c, r = open_stream(s.port, "/v1/completions",
                           {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0,
                            "stream_options": {"include_usage": True}})
        first = None
        for line in iter(r.readline, b""):
            if line.startswith(b"data:"):
                first = json.loads(line[5:])
                break
        assert first and first["choices"][0]["finish_reason"] is None, first
        s.proc.send_signal(signal.SIGTERM)
        assert s.wait_line("stopping", 10), s.stderr()
        # It takes no new connections (the listener closes at the signal).
        end = time.monotonic() + 5
        while True:
            try:
                socket.create_connection((HOST, s.port), timeout=2).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < end, "still accepting connections 5 s after SIGTERM"
            time.sleep(0.05)
        # The request in flight runs to its end.
        events = [first] + read_sse(r)
        c.close()
        text, finish = stream_text(events)
        assert finish == "length" and text, events[-4:]
        assert events[-2]["usage"]["completion_tokens"] == 64, events[-2]
        rc = s.terminate(timeout=30)
        assert rc == 0, f"exit code {rc} after SIGTERM:\n{s.stderr()}"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((HOST, s.port), timeout=2)
    finally:
        s.kill()
