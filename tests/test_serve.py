"""`twice serve`: the real server on a free local port (a tiny model), driven by the official
openai client and httpx. The server prints "listening on URL" when it accepts connections;
tests wait for that line (or for a condition the server reports), never for a time."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from clirun import one_error_line, run_inprocess

openai = pytest.importorskip("openai")

TWICE = [sys.executable, "-c", "from twice.cli.app import main; main()"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one thread (conftest.one_thread)."""


class Server:
    """`twice serve ARGS --port 0` in a process of its own; stderr collected by a thread."""

    def __init__(self, args, env):
        self.proc = subprocess.Popen([*TWICE, "serve", *args, "--port", "0"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.url = None
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("listening on "):
                self.url = line.split()[2]
                break
        if self.url is None:
            self.proc.wait()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def metrics(self, **headers) -> dict:
        text = httpx.get(self.url + "/metrics", headers=headers).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        self.reader.join(10)


def _env(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return {**os.environ, "TWICE_CACHE": str(base / "twice-cache"),
            "TWICE_CPU_AUTO_DTYPE": "float32", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def model(model_dirs):
    return str(model_dirs("llama"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(["-m", model, "--dtype", "float32", "--max-batch", "8", "--max-new-tokens", "16", "--threads", "1"],
               _env(tmp_path_factory))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(model):
    from twice.core.engine import Engine
    from twice.weights.load import load

    m = load(model, device="cpu", dtype="float32")
    return Engine(m.model, m.tokenizer, m.eos_token_ids)


def _generate(args, capsys, model) -> str:
    r = run_inprocess(["generate", *args, "-m", model, "--dtype", "float32", "--temperature", "0"], capsys)
    assert r.code == 0, r.err
    return r.out[:-1]  # generate ends the text with a newline


def test_completions_greedy_text_equals_twice_generate(server, model, capsys):
    want = _generate(["Hello there, how", "--raw", "-n", "12"], capsys, model)
    client = server.client()
    r = client.completions.create(model=model, prompt="Hello there, how", max_tokens=12, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason in ("length", "stop") and r.id.startswith("cmpl-")
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    streamed = client.completions.create(model=model, prompt="Hello there, how", max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices


def test_presence_and_frequency_penalties_are_openais_rule(server, model, engine):
    """Greedy with presence_penalty p and frequency_penalty f: each token is the argmax of the
    model's logits less f · (times the token was generated so far) + p · (generated at all),
    OpenAI's rule over the completion's own tokens, computed here from full forward passes."""
    import torch

    from twice.core.cache import KVCache

    prompt = engine.tokenizer.encode("the the the the", add_special_tokens=False)  # plain greedy repeats itself
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "frequency_penalty": 1.5,
            "presence_penalty": 0.5}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    ids, counts = list(prompt), torch.zeros(engine.config.vocab_size)
    with torch.inference_mode():
        for _ in range(12):
            fresh = KVCache(engine.config, 1, 64, torch.float32, "cpu")  # a full forward pass each token
            logits = engine.model(torch.tensor([ids]), fresh).float()[0]
            token = int(torch.argmax(logits - 1.5 * counts - 0.5 * (counts > 0)))
            if token in engine.eos:
                break
            ids.append(token)
            counts[token] += 1
    want = engine.tokenizer.decode(ids[len(prompt):])
    assert r.json()["choices"][0]["text"] == want
    plain = _post(server, "/v1/completions", {**body, "frequency_penalty": 0, "presence_penalty": 0})
    assert plain.json()["choices"][0]["text"] != want  # the penalties changed this completion


def test_logit_bias_is_added_to_the_logits_before_sampling(server, model, engine):
    """Greedy with logit_bias: each token is the argmax of the model's logits plus the bias
    (computed here from full forward passes); -100 on the plain greedy tokens steers away
    from all of them, +100 forces one; bad entries are 400s naming logit_bias."""
    import torch

    from twice.core.cache import KVCache

    prompt = engine.tokenizer.encode("Hello there, how", add_special_tokens=False)
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    plain = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    banned = set(engine.tokenizer.encode(plain, add_special_tokens=False))
    bias = {str(t): -100 for t in banned} | {"7": 3.5}
    r = _post(server, "/v1/completions", {**body, "logit_bias": bias})
    assert r.status_code == 200, r.text
    add = torch.zeros(engine.config.vocab_size)
    for t, b in bias.items():
        add[int(t)] = b
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(8):
            logits = engine.model(torch.tensor([ids]), KVCache(engine.config, 1, 64, torch.float32, "cpu")).float()[0]
            token = int(torch.argmax(logits[-1] + add))
            if token in engine.eos:
                break
            ids.append(token)
    got = r.json()["choices"][0]["text"]
    assert got == engine.tokenizer.decode(ids[len(prompt):]) and got != plain
    assert not banned & set(ids[len(prompt):])
    forced = _post(server, "/v1/completions", {**body, "logit_bias": {"42": 100}, "ignore_eos": True})
    assert forced.json()["choices"][0]["text"] == engine.tokenizer.decode([42] * 8)
    streamed = _post(server, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 3, "stream": True, "logit_bias": {"42": 100},
                                                     "ignore_eos": True})
    assert streamed.status_code == 200 and streamed.text.count("data: ") >= 4, streamed.text
    vocab = engine.config.vocab_size
    for bad, words in (([1], "must be an object of token ids to numbers, got [1]"),
                       ({"x": 1}, 'the key "x" is not a token id'),
                       ({"01": 1}, "is not a token id"), ({"-1": 1}, "is not a token id"),
                       ({str(vocab): 1}, f'token id "{vocab}" is outside the vocabulary'),
                       ({"9" * 80: 1}, 'token id "' + "9" * 56 + '... is outside'),
                       ({"5": 101}, "must be a number in [-100, 100], got 101"),
                       ({"5": True}, "got true"), ({"5": "1"}, 'got "1"'), ({"5": None}, "got null")):
        e = _error(_post(server, "/v1/completions", {**body, "logit_bias": bad}), 400, "invalid_value", [words])
        assert e["param"] == "logit_bias", e


def test_chat_streaming_and_not_equal_twice_generate(server, model, capsys):
    want = _generate(["Tell me a story", "-n", "10"], capsys, model)
    client = server.client()
    messages = [{"role": "user", "content": "Tell me a story"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    stream = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=10, temperature=0,
                                            stream=True, logprobs=True, top_logprobs=2)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    lps = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert lps and all(e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
                       for e in lps)
    assert [m.id for m in client.models.list().data] == [model]


def test_32_concurrent_streams_get_their_own_texts_and_join_the_running_batch(server, engine, model, count=32):
    """32 streaming requests of different lengths (3 to 15 tokens, eos ignored) against 8
    rows: each text is its prompt's alone, and the requests beyond the first 8 joined the
    running batch while others decoded (the scheduler's own counter)."""
    from twice.core.engine import Done, GenerationSettings, Request

    words = ["apple", "river", "stone", "cloud", "maple", "ember", "frost", "grove"]
    prompts = [f"{words[i % 8]} {words[(i * 3 + 1) % 8]} {i}" for i in range(count)]
    lengths = [3 + (i * 5) % 13 for i in range(count)]
    want = [[e for e in engine.generate(Request(text=p), GenerationSettings(max_new_tokens=n, ignore_eos=True),
                                        reuse_cache=False) if isinstance(e, Done)][0].result.text
            for p, n in zip(prompts, lengths)]
    before = server.metrics().get("twice_joined_running_total", 0)

    async def one(client, prompt, n):
        body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text, finish = [], None
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
        return "".join(text), finish

    async def all_of_them():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            # An anchor decodes first (its first token is out), so the others arrive during its decode.
            anchor = {"model": model, "prompt": "anchor", "max_tokens": 250, "ignore_eos": True, "stream": True}
            async with client.stream("POST", server.url + "/v1/completions", json=anchor) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break
                return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    got = asyncio.run(all_of_them())
    assert [t for t, _ in got] == want
    assert all(f == "length" for _, f in got)
    after = server.metrics()
    # Requests that arrived while the anchor (and others) decoded joined the running batch; how
    # many depends on how fast the client sends them (each of the 32 that had to wait for a row did).
    assert after["twice_joined_running_total"] - before >= 1
    _wait_idle(server)  # the anchor's row, freed when its stream closed


def _wait_idle(server) -> dict:
    for _ in range(10_000):  # until the server reports it (each scrape is a round trip, no sleeping)
        m = server.metrics()
        if m["twice_running_requests"] == 0 and m["twice_waiting_requests"] == 0:
            return m
    pytest.fail(f"the server still runs requests: {m}")


def test_a_disconnected_stream_frees_its_row(server, model):
    m0 = _wait_idle(server)
    body = {"model": model, "prompt": "a long story", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break  # leaving the block closes the connection mid-stream
    for _ in range(10_000):  # until the server reports it (each scrape is a round trip, no sleeping)
        m = server.metrics()
        if m["twice_cancelled_total"] > m0.get("twice_cancelled_total", 0) and m["twice_running_requests"] == 0:
            break
    else:
        pytest.fail(f"the row was not freed: {m}")
    # it stopped well before its budget (the context: about 250 tokens)
    assert m["twice_generation_tokens_total"] - m0["twice_generation_tokens_total"] < 200


def _post(server, path, body=None, raw=None, **headers):
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json", **headers},
                      timeout=60)


def _error(r, status, code=None, words=()):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and "\n" not in e["message"]
    if code is not None:
        assert e["code"] == code, e
    for w in words:
        assert w in e["message"], e
    return e


def test_bad_requests_get_the_documented_status_and_shape(server, model, engine):
    ok = {"model": model, "prompt": "hi", "max_tokens": 2}
    _error(_post(server, "/v1/completions", raw=b"{not json"), 400, "invalid_json")
    _error(_post(server, "/v1/completions", raw=b"\xff\xfe"), 400, "invalid_json")
    _error(_post(server, "/v1/completions", raw=b"[1, 2]"), 400, "invalid_body")
    _error(_post(server, "/v1/completions", raw=b"[" * 100 + b"]" * 100), 400, "invalid_json", ["nested"])
    # a compressed body is named as such, not "not UTF-8" (nor read as it is when it happens to be text)
    import gzip

    for body in (gzip.compress(json.dumps(ok).encode()), json.dumps(ok).encode()):
        _error(_post(server, "/v1/completions", raw=body, **{"content-encoding": "gzip"}), 415,
               "unsupported_encoding", ['content-encoding "gzip" is not supported'])
    assert _post(server, "/v1/completions", raw=json.dumps(ok).encode(),
                 **{"content-encoding": "identity"}).status_code == 200
    # a key given twice is refused, as in batch lines and chat files (json would keep the last)
    _error(_post(server, "/v1/completions", raw=b'{"prompt": "hi", "max_tokens": 2, "max_tokens": 3}'), 400,
           "invalid_json", ['the key "max_tokens" appears twice'])
    _error(_post(server, "/v1/completions", raw=b'{"prompt": "hi", "logit_bias": {"1": 5, "1": 1000}}'), 400,
           "invalid_json", ['the key "1" appears twice'])
    _error(_post(server, "/v1/completions", {**ok, "temprature": 0.5}), 400, "unknown_field", ["temprature"])
    _error(_post(server, "/v1/completions", {**ok, "temperature": "hot"}), 400, "invalid_value", ["temperature"])
    _error(_post(server, "/v1/completions", {**ok, "max_tokens": 0}), 400, "invalid_value", ["max_tokens"])
    _error(_post(server, "/v1/completions", {**ok, "top_p": 1.5}), 400, "invalid_value", ["top_p"])
    e = _error(_post(server, "/v1/completions", {**ok, "max_tokens": True}), 400, "invalid_value",
               ["max_tokens must be", "got true"])  # JSON's spelling, not Python's True
    assert e["param"] == "max_tokens"
    e = _error(_post(server, "/v1/completions", {**ok, "stop": ["x", ""]}), 400, "invalid_value", ["stop string is empty"])
    assert e["param"] == "stop"
    e = _error(_post(server, "/v1/completions", {**ok, "stream_options": {"include_usage": True}}), 400,
               "invalid_value", ['only allowed with "stream": true'])  # OpenAI's rule: it would be ignored
    assert e["param"] == "stream_options"
    _error(_post(server, "/v1/completions", {**ok, "stop": [1]}), 400, None, ["stop"])
    _error(_post(server, "/v1/completions", {**ok, "n": 2}), 400, "unsupported")
    _error(_post(server, "/v1/completions", {**ok, "prompt": 5}), 400, None, ["prompt"])
    _error(_post(server, "/v1/completions", {**ok, "prompt": [10**9]}), 400, None, ["vocabulary"])
    _error(_post(server, "/v1/completions", {**ok, "prompt": []}), 400, "invalid_prompt", ["empty list"])
    _error(_post(server, "/v1/completions", {**ok, "prompt": [1.0]}), 400, "invalid_value", ["prompt[0]", "1.0"])
    _error(_post(server, "/v1/completions", {**ok, "prompt": [3, True]}), 400, "invalid_value", ["prompt[1]", "true"])
    _error(_post(server, "/v1/completions", {**ok, "prompt": ["a", "b"]}), 400, "unsupported", ["2 prompts"])
    e = _error(_post(server, "/v1/completions", {"model": model}), 400, "missing_required_parameter")
    assert e["param"] == "prompt"
    _error(_post(server, "/v1/chat/completions", {"model": model, "messages": [{"role": "wizard", "content": "x"}]}),
           400, None, ["role"])
    _error(_post(server, "/v1/chat/completions", {"model": model, "messages": "hi"}), 400, "invalid_value")
    # unknown fields inside a message, a content part, response_format's json_schema (they passed silently)
    chat = {"model": model, "max_tokens": 2}
    e = _error(_post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi", "foo": 1}]}),
               400, "unknown_field", ['unknown field "foo" in messages[0]'])
    assert e["param"] == "messages"
    _error(_post(server, "/v1/chat/completions",
                 {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "txet": 1}]}]}),
           400, "unknown_field", ['"txet" in messages[0].content[0]'])
    _error(_post(server, "/v1/chat/completions",
                 {**chat, "messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]},
                                       {"role": "user", "content": "hi"}]}), 400, "unsupported", ["tool_calls"])
    e = _error(_post(server, "/v1/chat/completions",
                     {**chat, "messages": [{"role": "user", "content": "hi", "name": "ann"}],
                      "response_format": {"type": "json_schema",
                                          "json_schema": {"name": "x", "schema": {"type": "object"}, "stict": True}}}),
               400, None, ['unknown field "stict"', "json_schema"])
    assert e["param"] == "response_format"
    _error(_post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}],
                                                  "response_format": {"type": "json_object", "schema": {}}}),
           400, None, ['unknown field "schema"'])
    e = _error(_post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}],
                                                      "top_logprobs": 2}), 400, "invalid_value", ["logprobs"])
    assert e["param"] == "top_logprobs"
    e = _error(_post(server, "/v1/completions", {**ok, "stream": True, "stream_options": {"include_usage": "yes"}}),
               400, "invalid_value", ["include_usage"])
    assert e["param"] == "stream_options"
    e = _error(_post(server, "/v1/chat/completions", {"model": model}), 400, "missing_required_parameter",
               ["messages is missing"])
    assert e["param"] == "messages"  # named though the body has no such key
    # no request names a file or a model to load: another model id is refused, nothing is read
    _error(_post(server, "/v1/completions", {**ok, "model": "/etc/passwd"}), 404, "model_not_found")
    # bodies over 4 MiB: refused by their declared length, or as they arrive
    _error(_post(server, "/v1/completions", raw=b" " * (4 * 2**20 + 1)), 413, "body_too_large")

    def chunked():
        for _ in range(5):
            yield b" " * 2**20

    _error(httpx.post(server.url + "/v1/completions", content=chunked(), timeout=60), 413, "body_too_large")
    # a prompt longer than the context: 400 naming both lengths
    context = engine.context_length
    e = _error(_post(server, "/v1/completions", {**ok, "prompt": [5] * (context + 3)}), 400, "invalid_prompt")
    assert str(context + 3) in e["message"] and str(context) in e["message"]
    # max_tokens beyond the context is clamped: finish_reason length
    r = _post(server, "/v1/completions", {**ok, "prompt": [5] * (context - 3), "max_tokens": 100, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 3
    _error(httpx.get(server.url + "/v1/nothing"), 404, "not_found")
    _error(httpx.get(server.url + "/v1/completions"), 405)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_api_key_queue_limit_and_cors(model, tmp_path_factory):
    env = {**_env(tmp_path_factory), "TWICE_API_KEY": "s3cret"}
    s = Server(["-m", model, "--dtype", "float32", "--max-queue", "0", "--cors", "https://app.example",
                "--threads", "1"], env)
    try:
        assert httpx.get(s.url + "/health").status_code == 200  # no key needed
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Bearer s3cret2"}):
            _error(httpx.get(s.url + "/v1/models", headers=headers), 401, "invalid_api_key")
            _error(httpx.get(s.url + "/metrics", headers=headers), 401, "invalid_api_key")
        good = {"authorization": "Bearer s3cret"}
        assert httpx.get(s.url + "/v1/models", headers=good).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        # --max-queue 0: a request that finds its row free runs (the full rows' 429: below)
        r = _post(s, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}, **good)
        assert r.status_code == 200, r.text
        pre = httpx.options(s.url + "/v1/completions", headers={"origin": "https://app.example",
                                                                 "access-control-request-method": "POST"})
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.get(s.url + "/health", headers={"origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        refused = httpx.options(s.url + "/v1/completions", headers={"origin": "https://evil.example",
                                                                    "access-control-request-method": "POST"})
        _error(refused, 400, "cors_refused")  # the error shape, not plain text
        assert "Disallowed CORS origin" in refused.json()["error"]["message"]
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_a_q8_0_cache_serves_generates_text_and_the_metrics_count_the_traffic(model_dirs, tmp_path_factory, capsys):
    """--kv-dtype on serve (generate's option; serve had none): the greedy text of
    `twice generate --kv-dtype q8_0`, the startup line names the cache, and /metrics carries
    the issue's series with the request counted: TTFT and inter-token histograms, prefill and
    decode rates, KV bytes (a q8_0 cache's: 34 bytes per 32 values)."""
    folder = str(model_dirs("llama-hd64"))  # head size 64: whole blocks of 32
    s = Server(["-m", folder, "--dtype", "float32", "--kv-dtype", "q8_0", "--threads", "1", "--max-batch", "2"],
               _env(tmp_path_factory))
    try:
        assert "q8_0 KV cache" in "".join(s.lines)
        body = {"model": folder, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        r = _post(s, "/v1/completions", body)
        assert r.status_code == 200, r.text
        want = _generate(["--raw", "Once upon a time", "-n", "8", "--kv-dtype", "q8_0"], capsys, folder)
        assert r.json()["choices"][0]["text"] == want
        n = r.json()["usage"]["completion_tokens"]
        assert n >= 2, r.json()  # at least one gap between tokens to time
        m = s.metrics()
        assert m["twice_time_to_first_token_seconds_count"] == 1
        assert m["twice_inter_token_seconds_count"] == n - 1
        assert m["twice_prefill_tokens_per_second"] > 0 and m["twice_decode_tokens_per_second"] > 0
        assert m["twice_kv_cache_bytes_used"] == 0  # nothing running
        # 2 layers × K and V × 1 kv head × 2 blocks of 34 bytes per token, over the rows and columns held
        assert m["twice_kv_cache_bytes_allocated"] > 0 and m["twice_kv_cache_bytes_allocated"] % (2 * 2 * 68) == 0
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_response_format_json_schema_output_parses(server, model):
    """Structured output through the scheduler (core/constraints.py's matcher per row)."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    client = server.client()
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "yes or no?"}],
                                       max_tokens=40, temperature=0.7, seed=3,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(r.choices[0].message.content)["answer"] in ("yes", "no")
    e = _error(_post(server, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                                      "response_format": {"type": "json_schema",
                                                                          "json_schema": {"schema": {"type": 5}}}}),
               400, "invalid_schema")
    assert "\n" not in e["message"]


def test_odd_requests_found_by_a_hostile_client(server, model):
    """Each was a 500, a redirect, a 405 or an empty 200 before: a key or a stop string with a
    lone surrogate (escaped JSON), HEAD, a trailing slash, a grammar whose language is empty,
    JSON Schema's `true`."""
    ok = {"model": model, "prompt": "hi", "max_tokens": 2}
    e = _error(_post(server, "/v1/completions", raw=b'{"prompt": "hi", "max_tokens": 2, "\\udc00x": 1}'), 400,
               "unknown_field")
    assert "\\udc00" in e["message"]
    _error(_post(server, "/v1/completions", {**ok, "stream": True, "stream_options": {"\udc00": 1}}), 400,
           "unknown_field")
    _error(_post(server, "/v1/completions", raw=b'{"prompt": "hi", "max_tokens": 2, "stop": "\\ud800"}'), 400)
    for path in ("/health", "/v1/models", "/metrics"):
        assert httpx.head(server.url + path).status_code == 200, path
    r = httpx.get(server.url + "/v1/models/", headers={"host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers
    pytest.importorskip("llguidance")
    for fmt in ({"type": "regex", "regex": "[^\\s\\S]"}, {"type": "lark", "grammar": "start: start"},
                {"type": "gbnf", "grammar": "root ::= root"}):
        e = _error(_post(server, "/v1/completions", {**ok, "response_format": fmt}), 400)
        assert "can never be satisfied" in e["message"], e
    r = _post(server, "/v1/completions", {**ok, "max_tokens": 6, "response_format":
                                          {"type": "json_schema", "json_schema": {"name": "any", "schema": True}}})
    assert r.status_code == 200, r.text
    _error(_post(server, "/v1/completions", {**ok, "response_format":
                                             {"type": "json_schema", "json_schema": {"name": "no", "schema": False}}}),
           400, "invalid_schema")
    # A grammar llguidance gives up on part way: a 400 naming why, never a "stop" on
    # incomplete output (a stream: an error event and no finish_reason, no [DONE]).
    too_complex = {"type": "regex", "regex": "(x{1000}){1000}"}
    _error(_post(server, "/v1/completions", {**ok, "prompt": "x", "max_tokens": 16, "response_format": too_complex}),
           400, "constraint_failed", ["structured output stopped after", "constraint engine failed"])
    r = _post(server, "/v1/completions", {**ok, "prompt": "x", "max_tokens": 16, "stream": True,
                                          "response_format": too_complex})
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and "[DONE]" not in r.text, r.text
    assert events[-1]["error"]["code"] == "constraint_failed"
    assert all(choice["finish_reason"] is None for e in events[:-1] for choice in e["choices"])
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # and it still serves


def test_a_shared_system_prompt_is_prefilled_once(server, model):
    """Two chats with the same long system prompt: the second copies its start from the first's
    cached row (prefix-cache counters in /metrics)."""
    system = {"role": "system", "content": "You are a careful assistant who answers in full sentences " * 4}
    client = server.client()
    m0 = server.metrics()
    for question in ("What is a cache?", "Why is the sky blue?"):
        client.chat.completions.create(model=model, messages=[system, {"role": "user", "content": question}],
                                       max_tokens=3, temperature=0)
    m = server.metrics()
    assert m["twice_prefix_cache_hits_total"] - m0.get("twice_prefix_cache_hits_total", 0) >= 1
    assert m["twice_prefix_cache_tokens_total"] - m0.get("twice_prefix_cache_tokens_total", 0) >= 16


def test_cors_is_off_by_default(server):
    r = httpx.get(server.url + "/health", headers={"origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers


def test_another_address_without_a_key_is_warned_about(model, tmp_path_factory):
    """--host other than 127.0.0.1/localhost/::1 without --api-key: one note that anyone who can
    reach the address can use the model (127.0.0.2: still this machine's loopback)."""
    s = Server(["-m", model, "--dtype", "float32", "--host", "127.0.0.2", "--threads", "1"], _env(tmp_path_factory))
    try:
        notes = [line for line in s.lines if "without an API key" in line]
        assert len(notes) == 1 and "127.0.0.2" in notes[0] and "--api-key" in notes[0], s.lines
        assert s.url.startswith("http://127.0.0.2:")
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_bad_flags_fail_in_one_line(capsys, model):
    for args, words in ((["--port", "70000"], "--port"), (["--max-batch", "0"], "--max-batch"),
                        (["--api-key", " "], "--api-key"), (["--host", "no.such.host.invalid"], "--host"),
                        (["--temperature", "-1"], "temperature")):
        r = run_inprocess(["serve", "-m", model, *args], capsys)
        assert words in one_error_line(r)


def _sigterm_after_the_first_chunk(s: Server, path: str, body: dict) -> list[str]:
    """Stream `body`, SIGTERM the server at its first data chunk, and return the data lines
    that came after it; the server must then exit 0."""
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", s.url + path, json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            s.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
    s.proc.wait(120)
    s.reader.join(10)
    assert s.proc.returncode == 0, "".join(s.lines)
    return rest


@pytest.mark.slow
def test_sigterm_drains_the_requests_in_flight_and_exits_0(model, tmp_path_factory):
    s = Server(["-m", model, "--dtype", "float32", "--drain-seconds", "60", "--threads", "1"], _env(tmp_path_factory))
    body = {"model": model, "prompt": "drain me", "max_tokens": 40, "ignore_eos": True, "stream": True}
    texts = _sigterm_after_the_first_chunk(s, "/v1/completions", body)
    assert texts[-1] == "data: [DONE]"
    assert json.loads(texts[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert any("draining" in line for line in s.lines)


@pytest.mark.slow
def test_requests_past_the_drain_deadline_end_with_a_503_not_a_bare_500(model, tmp_path_factory):
    """SIGTERM with --drain-seconds 0 while a request is still prefilling (one token a step):
    the worker cancels it at the deadline and its stream ends with the `draining` error event
    (uvicorn's own timeout would have cut it with a plain-text 500 and a traceback); exit 0."""
    s = Server(["-m", model, "--dtype", "float32", "--drain-seconds", "0", "--prefill-chunk", "1", "--threads", "1"],
               _env(tmp_path_factory))
    body = {"model": model, "messages": [{"role": "user", "content": "drain " * 25}], "max_tokens": 40,
            "stream": True}
    rest = _sigterm_after_the_first_chunk(s, "/v1/chat/completions", body)  # the role chunk: before the prefill
    assert rest and json.loads(rest[-1][6:])["error"]["code"] == "draining", (rest, "".join(s.lines))
    assert not any("Traceback" in line for line in s.lines), "".join(s.lines)


class _IdleScheduler:
    """What Worker reads of a scheduler with nothing to do."""

    has_work, running, waiting_count = False, (), 0

    def cache_bytes(self):
        return 0, 0

    class counters:  # noqa: N801 - an attribute holder, as Scheduler.counters
        @staticmethod
        def to_dict():
            return {}


def test_logprobs_of_tokens_holding_part_of_a_character(model):
    """Byte-level BPE splits an emoji over tokens: each such token's logprob entry carries its
    own bytes (joined, they rebuild the text), its token string is OpenAI's `bytes:\\xNN` form
    (so completions' top_logprobs keys stay distinct), and text_offset counts visible characters."""
    from types import SimpleNamespace

    from twice.cli.serve_http import Reply
    from twice.weights.tokenizer import Tokenizer

    tokenizer = Tokenizer(Path(model))
    text = "Emoji: \U0001f389\U0001f38a é中"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream, events = tokenizer.stream(), []
    for i in ids:
        events.append(SimpleNamespace(token_id=i, logprob=-1.0, top_logprobs=[(i, -1.0)], text=stream.step(i)))
    events[-1].text += stream.finish()
    chat = Reply(True, "m", tokenizer, 1).logprobs_object([Reply(True, "m", tokenizer, 1).logprob_entry(e)
                                                           for e in events])["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat).decode() == text
    partial = [e for e in chat if e["token"].startswith("bytes:")]
    assert partial, [e["token"] for e in chat]  # the tokenizer did split a character
    for e in partial:
        assert e["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in e["bytes"])
        assert e["top_logprobs"][0]["bytes"] == e["bytes"]
    reply = Reply(False, "m", tokenizer, 1)
    entries = [reply.logprob_entry(e) for e in events]
    half = len(entries) // 2
    first, second = reply.logprobs_object(entries[:half]), reply.logprobs_object(entries[half:])  # two chunks
    offsets = first["text_offset"] + second["text_offset"]
    shown = [len(e.text) for e in events]
    assert offsets == [sum(shown[:i]) for i in range(len(events))]
    assert all(t == e["token"] for t, e in zip(first["tokens"] + second["tokens"], chat))


@pytest.mark.parametrize("running, waiting, max_queue, refused", [
    (1, 0, 0, True),  # the one row busy, no waiting allowed
    (1, 2, 2, True),  # two waiting already, two allowed
    (1, 1, 2, False),  # room in the queue
    (0, 0, 0, False),  # a free row: it never waits, so --max-queue 0 does not refuse it
])
def test_the_queue_limit_counts_requests_that_would_wait(running, waiting, max_queue, refused):
    """--max-queue: 429 with Retry-After once the rows are full and the queue is; the rows
    and the queue as the worker last published them (its snapshot), in process."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from twice.cli.serve_http import Parser, ServerConfig, Snapshot, State, Worker, create_app
    from twice.core.engine import GenerationSettings

    scheduler = _IdleScheduler()
    scheduler.max_batch = 1
    worker = Worker()
    worker.start(lambda: scheduler)
    try:
        worker.snapshot = Snapshot(running=running, waiting=waiting)
        engine = SimpleNamespace(config=SimpleNamespace(vocab_size=100), tokenizer=None)
        state = State(worker, Parser(engine, "m", GenerationSettings(), 64), ServerConfig("m", max_queue=max_queue))
        with TestClient(create_app(state), raise_server_exceptions=False) as client:
            r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        if refused:
            _error(r, 429, "queue_full")
            assert r.headers["retry-after"] == "1"
        else:  # past the limit's check (the idle stand-in cannot tokenize: whatever comes next is no 429)
            assert r.status_code != 429, r.text
    finally:
        worker.stop(timeout=10)


def test_the_worker_builds_its_scheduler_on_its_own_thread():
    """`twice serve` loads the model on the thread that steps it (one OpenMP pool: a native
    step on a second thread after a load on the main one ran 5x slower, libgomp sleeping at
    every barrier): Worker.start(build) runs build there and returns its scheduler; build's
    error is raised by start."""
    from twice.cli.serve_http import Worker
    from twice.core.errors import PromptError

    ran_on = []
    worker = Worker()
    scheduler = worker.start(lambda: ran_on.append(threading.get_ident()) or _IdleScheduler())
    try:
        assert isinstance(scheduler, _IdleScheduler) and worker.scheduler is scheduler
        assert ran_on == [worker.thread.ident] != [threading.get_ident()]
    finally:
        worker.stop(timeout=10)
    assert not worker.thread.is_alive()

    def fail():
        raise PromptError("no such model")

    failing = Worker()
    with pytest.raises(PromptError, match="no such model"):
        failing.start(fail)
    failing.thread.join(10)
    assert not failing.thread.is_alive()
