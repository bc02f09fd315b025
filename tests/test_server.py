"""`longctx serve` as users reach it: a real server process on 127.0.0.1 (a free port), driven by
the `openai` client and simonw's `llm` CLI, on a tiny random model (fast, deterministic greedy
answers); follow-ups, errors, concurrency, a client that leaves mid-stream, a killed server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import make_tiny_model

openai = pytest.importorskip("openai")

DOC = "The lighthouse keeper is Ada Quill. The island has 412 sheep and one blue boat.\n" * 8


def _http(method: str, url: str, body: bytes | None = None, timeout: float = 120):
    """(status, body bytes) of one plain HTTP request (no client library in between)."""
    req = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _stream_lines(url: str, payload: dict, most: int | None = None) -> list[str]:
    """The non-empty lines of a streamed response (the first `most` only, then hang up)."""
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), method="POST", headers={"content-type": "application/json"}
    )
    lines = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line:
                lines.append(line)
            if most is not None and len(lines) >= most:
                break
    return lines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path, model: Path) -> dict:
    return {**os.environ, "LONGCTX_HOME": str(home), "LONGCTX_MODEL": str(model), "PYTHONUNBUFFERED": "1"}


def _cli(env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longctx", *args], env=env, capture_output=True, text=True, timeout=timeout)


class Server:
    def __init__(self, env: dict, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "longctx", "serve", "--port", str(self.port), *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.proc.stdout.read()}")
            try:
                if _http("GET", self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise AssertionError("server did not come up in 120 s")

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=120, **kw)

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = make_tiny_model(root / "tiny", context=4096, attn_gain=2.0)
    env = _env(root / "home", model)
    doc = root / "facts.txt"
    doc.write_text(DOC)
    res = _cli(env, "ingest", str(doc))
    assert res.returncode == 0, res.stderr
    info = json.loads(_cli(env, "info", "facts.txt", "--json").stdout)
    server = Server(env)
    yield server, env, info
    server.stop()


def _ask(client, messages, **kw):
    return client.chat.completions.create(
        model="facts.txt", messages=messages, max_tokens=kw.pop("max_tokens", 12), temperature=0, **kw
    )


def test_models_health_and_a_plain_answer(served):
    server, _, info = served
    client = server.client()
    ids = [m.id for m in client.models.list().data]
    assert ids == ["facts.txt"]
    r = _ask(client, [{"role": "user", "content": "Who is the lighthouse keeper?"}])
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens_details.cached_tokens == info["tokens"]
    assert r.usage.prompt_tokens > info["tokens"] and r.usage.completion_tokens >= 1
    extra = choice.model_extra or {}
    assert extra["sources"][0]["file"] == "facts.txt"
    health = json.loads(_http("GET", server.url + "/health")[1])
    assert health["status"] == "ok" and info["id"] in health["warm_documents"]


def test_streaming_gives_the_same_answer_with_usage_and_sources(served):
    server, _, info = served
    client = server.client()
    messages = [{"role": "user", "content": "How many sheep are there?"}]
    whole = _ask(client, messages).choices[0].message.content
    chunks = list(_ask(client, messages, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and (finals[0].choices[0].model_extra or {})["sources"][0]["file"] == "facts.txt"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == info["tokens"]
    lines = _stream_lines(
        server.url + "/v1/chat/completions", {"model": "facts.txt", "messages": messages, "stream": True, "max_tokens": 4}
    )
    assert lines[-1] == "data: [DONE]" and all(ln.startswith(("data: ", ":")) for ln in lines)


def test_a_follow_up_reuses_the_conversation_and_matches_a_fresh_server(served):
    server, env, info = served
    client = server.client()
    first = [{"role": "user", "content": "Who is the lighthouse keeper?"}]
    a1 = _ask(client, first).choices[0].message.content
    follow = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And the boat?"}]
    r = _ask(client, follow)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached > info["tokens"]  # the first turn was not prefilled again
    assert r.usage.prompt_tokens - cached < 60  # only the new turn (byte-level tokens)
    other = Server(env)  # no kept conversation there: the history is prefilled
    try:
        fresh = _ask(other.client(), follow)
    finally:
        other.stop()
    assert fresh.usage.prompt_tokens_details.cached_tokens == info["tokens"]
    assert fresh.usage.prompt_tokens == r.usage.prompt_tokens  # the same conversation, laid out alike
    assert fresh.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize(
    "body, status, code",
    [
        (b"{not json", 400, None),
        (json.dumps({"model": "nope.txt", "messages": [{"role": "user", "content": "q"}]}).encode(), 404, "model_not_found"),
        (json.dumps({"model": "facts.txt"}).encode(), 400, None),
        (
            json.dumps({"model": "facts.txt", "messages": [{"role": "user", "content": "q"}], "max_tokens": 10**9}).encode(),
            400,
            None,
        ),
        (json.dumps({"model": "facts.txt", "messages": [{"role": "assistant", "content": "q"}]}).encode(), 400, None),
        (
            json.dumps({"model": "facts.txt", "messages": [{"role": "user", "content": "word " * 5000}]}).encode(),
            400,
            "context_length_exceeded",
        ),
    ],
)
def test_bad_requests_get_openai_shaped_4xx_and_the_server_goes_on(served, body, status, code):
    server, _, _ = served
    code_, raw = _http("POST", server.url + "/v1/chat/completions", body)
    assert code_ == status, raw
    err = json.loads(raw)["error"]
    assert err["message"] and err["type"] and err.get("code") == code
    assert _ask(server.client(), [{"role": "user", "content": "Still there?"}]).choices[0].message.content


def test_the_openai_client_raises_on_an_unknown_document(served):
    server, _, _ = served
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="missing", messages=[{"role": "user", "content": "q"}])


def test_four_concurrent_clients_get_the_sequential_answers(served):
    server, _, _ = served
    questions = [f"Question {i}: what colour is the boat?" for i in range(5)]
    client = server.client()
    want = {q: _ask(client, [{"role": "user", "content": q}]).choices[0].message.content for q in questions}
    got, errors = [], []

    def worker():
        c = server.client()
        for i in range(20):
            q = questions[i % len(questions)]
            try:
                got.append((q, _ask(c, [{"role": "user", "content": q}]).choices[0].message.content))
            except Exception as e:  # noqa: BLE001 - counted below
                errors.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert errors == [] and len(got) == 80
    assert all(text == want[q] for q, text in got)


def test_a_client_gone_mid_stream_frees_the_server(served):
    server, _, _ = served
    _stream_lines(
        server.url + "/v1/chat/completions",
        {
            "model": "facts.txt",
            "messages": [{"role": "user", "content": "Tell me everything."}],
            "stream": True,
            "max_tokens": 3000,
        },
        most=5,
    )
    start = time.time()
    assert _ask(server.client(), [{"role": "user", "content": "Quick one?"}], max_tokens=2).choices[0].message.content
    assert time.time() - start < 30  # not behind a 3000-token answer


def test_simonw_llm_talks_to_it(served, tmp_path):
    server, env, _ = served
    llm = Path(sys.executable).parent / "llm"
    if not llm.exists():
        pytest.skip("simonw's llm is not installed")
    user = tmp_path / "llm-user"
    user.mkdir()
    (user / "extra-openai-models.yaml").write_text(
        f"- model_id: facts\n  model_name: facts.txt\n  api_base: \"{server.url}/v1\"\n"
    )
    run_env = {**env, "LLM_USER_PATH": str(user), "OPENAI_API_KEY": "none"}
    res = subprocess.run(
        [str(llm), "-m", "facts", "-o", "temperature", "0", "-o", "max_tokens", "12", "Who is the lighthouse keeper?"],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    want = _ask(server.client(), [{"role": "user", "content": "Who is the lighthouse keeper?"}]).choices[0].message.content
    assert res.stdout.strip() == want.strip()


def test_api_key_is_required_when_set_and_beyond_loopback(served):
    _, env, _ = served
    res = _cli(env, "serve", "--host", "0.0.0.0", "--port", str(_free_port()), timeout=60)
    assert res.returncode == 1 and "--api-key" in res.stderr
    server = Server(env, "--api-key", "sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        assert [m.id for m in server.client(api_key="sekrit").models.list().data] == ["facts.txt"]
    finally:
        server.stop()


def test_a_killed_server_loses_nothing(served):
    _, env, info = served
    server = Server(env)
    try:
        stream = _ask(server.client(), [{"role": "user", "content": "Count the sheep slowly."}], stream=True, max_tokens=500)
        next(iter(stream))
    finally:
        server.stop(signal.SIGKILL)
    listed = json.loads(_cli(env, "list", "--json").stdout)
    assert [e["id"] for e in listed] == [info["id"]]
    res = _cli(env, "ask", "Who is the lighthouse keeper?", "--max-tokens", "4")
    assert res.returncode == 0 and res.stdout and "restored in" in res.stderr, res.stderr
