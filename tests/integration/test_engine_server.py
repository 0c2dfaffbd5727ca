"""The embedded model server as a real process (granian) on free ports: every endpoint.

Two servers run side by side: a free-sampling one, and a scripted-policy one with a batch
of one and a queue of one (for the 503 path). Responses are checked against a local copy
of the same weights (logprob truth over the wire) and the same tokenizer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from infra.localservers import free_port
from services.common.tokenization import ChatTokenizer
from services.engine.modelinit import init_model_dir, reseed_weights
from services.engine.weights import load_model

POLICY = Path(__file__).parents[1] / "fixtures" / "policies" / "regex_router.yaml"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]


def _start(
    model_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.engine",
        "--model-dir",
        str(model_dir),
        "--port",
        str(port),
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedded-server")
    v1 = init_model_dir(root / "v1")
    return v1, reseed_weights(v1, root / "v2", seed=1)


@pytest.fixture(scope="module")
def servers(model_dirs):
    v1, _ = model_dirs
    started = [
        _start(v1),
        _start(v1, "--policy", str(POLICY), "--max-batch", "1", "--max-queue", "1"),
    ]
    try:
        for proc, url in started:
            _wait_healthy(proc, url)
        yield started[0][1], started[1][1]
    finally:
        for proc, _ in started:
            _stop(proc)


@pytest.fixture(scope="module")
def tok(model_dirs):
    return ChatTokenizer.load(model_dirs[0])


def _post(url: str, path: str, body: dict | None = None, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(url + path, json=body if body is not None else {}, timeout=timeout)


def _engine_when(url: str, check, timeout: float = 30.0) -> dict:
    """The engine's state once ``check(state)`` holds: how long a request sent from a
    thread takes to reach the engine depends on the machine's load."""
    deadline = time.monotonic() + timeout
    while not check(state := httpx.get(url + "/server_info").json()["internal_states"][0]):
        assert time.monotonic() < deadline, state
        time.sleep(0.02)
    return state


def _in_background(fn):
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn()))
    thread.start()
    return thread, box


def test_info_endpoints(servers, model_dirs):
    url, _ = servers
    info = httpx.get(url + "/model_info").json()
    assert info["is_generation"] is True and info["weight_version"] == "1"
    assert info["architectures"] == ["Qwen2ForCausalLM"] and info["model_path"] == str(
        model_dirs[0]
    )
    assert httpx.get(url + "/get_model_info").json()["model_type"] == "qwen2"
    server = httpx.get(url + "/server_info").json()
    assert server["engine"]["max_batch"] == 32 and server["internal_states"][0]["paused"] is None
    assert httpx.get(url + "/get_weight_version").json() == {"weight_version": "1"}
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "v1"
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200


def test_generate_returns_true_logprobs_and_is_deterministic(servers, model_dirs, tok):
    url, _ = servers
    model = load_model(model_dirs[0])
    prompt = tok.render_ids([{"role": "user", "content": "Say something."}])
    body = {
        "input_ids": prompt,
        "sampling_params": {
            "max_new_tokens": 24,
            "temperature": 0.8,
            "top_p": 0.95,
            "sampling_seed": 5,
        },
        "return_logprob": True,
    }
    first, second = _post(url, "/generate", body).json(), _post(url, "/generate", body).json()
    assert first["output_ids"] == second["output_ids"]
    meta = first["meta_info"]
    assert meta["weight_version"] == "1" and meta["prompt_tokens"] == len(prompt)
    assert [e[1] for e in meta["output_token_logprobs"]] == first["output_ids"]
    truth = model.teacher_forced_logprobs(prompt + first["output_ids"], len(prompt))
    reported = [e[0] for e in meta["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(truth, reported, strict=True)) <= 1e-4
    batch = _post(
        url, "/generate", {"text": ["a", "b c"], "sampling_params": {"max_new_tokens": 2}}
    ).json()
    assert isinstance(batch, list) and len(batch) == 2


def test_chat_completions_token_extensions(servers, tok):
    url, _ = servers
    messages = [{"role": "user", "content": "hello"}]
    body = {
        "model": "v1",
        "messages": messages,
        "max_tokens": 8,
        "seed": 1,
        "logprobs": True,
        "return_prompt_token_ids": True,
        "return_token_ids": True,
        "return_meta_info": True,
        "stop": ["\n\n"],
    }
    out = _post(url, "/v1/chat/completions", body).json()
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == tok.render_ids(messages)
    assert choice["meta_info"]["weight_version"] == "1"
    assert [e[1] for e in choice["meta_info"]["output_token_logprobs"]] == choice["token_ids"]
    assert (
        len(choice["logprobs"]["content"])
        == len(choice["token_ids"])
        == out["usage"]["completion_tokens"]
    )
    same = _post(
        url, "/v1/chat/completions", {**body, "input_ids": choice["prompt_token_ids"]}
    ).json()
    assert same["choices"][0]["token_ids"] == choice["token_ids"]


def test_errors_are_sglang_error_bodies(servers):
    url, _ = servers
    bad = _post(url, "/generate", {"input_ids": [1], "sampling_params": {"top_p": 5}})
    assert (
        bad.status_code == 400
        and bad.json()["object"] == "error"
        and "top_p" in bad.json()["message"]
    )
    assert _post(url, "/generate", {}).status_code == 400
    unknown_role = _post(
        url, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}
    )
    assert (
        unknown_role.status_code == 400 and "Unknown message role" in unknown_role.json()["message"]
    )
    assert httpx.post(url + "/generate", content=b"{not json").status_code == 400
    assert httpx.get(url + "/nope").status_code == 404


def test_weight_update_pause_and_continue(servers, model_dirs, tok):
    url, _ = servers
    _, v2 = model_dirs
    greedy = {
        "input_ids": [11, 12, 13],
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
    }
    before = _post(url, "/generate", greedy).json()
    # long enough to be seen in flight on a fast CPU (~1,700 tokens/s seen)
    long_body = {
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    longer_body = {  # aborted in flight: its length only matters if the abort fails
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True},
    }
    thread, box = _in_background(lambda: _post(url, "/generate", long_body).json())
    _engine_when(url, lambda s: s["running"] or box)  # in flight (or, on a fast CPU, done)
    update = _post(url, "/update_weights_from_disk", {"model_path": str(v2)})
    assert update.status_code == 200 and update.json()["success"] is True
    assert "now 2" in update.json()["message"]
    thread.join(timeout=60)
    in_flight = box["value"]
    assert len(in_flight["output_ids"]) == 2000 and in_flight["meta_info"]["weight_version"] == "1"
    after = _post(url, "/generate", greedy).json()
    assert (
        after["meta_info"]["weight_version"] == "2" and after["output_ids"] != before["output_ids"]
    )
    assert httpx.get(url + "/model_info").json()["weight_version"] == "2"

    thread, box = _in_background(lambda: _post(url, "/generate", longer_body).json())
    _engine_when(url, lambda s: s["running"])
    assert _post(url, "/pause_generation", {"mode": "abort"}).json()["status"] == "ok"
    thread.join(timeout=30)
    assert box["value"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert box["value"]["meta_info"]["weight_version"] == "2"
    held, held_box = _in_background(lambda: _post(url, "/generate", greedy).json())
    _engine_when(url, lambda s: s["waiting"])
    time.sleep(0.3)
    assert held.is_alive()  # new requests wait while paused
    assert _post(url, "/flush_cache").status_code == 400  # a request is queued
    assert _post(url, "/continue_generation").json()["status"] == "ok"
    held.join(timeout=30)
    assert held_box["value"]["output_ids"] == after["output_ids"]
    assert _post(url, "/flush_cache").status_code == 200
    bad = _post(url, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert bad.status_code == 400 and bad.json()["success"] is False


def test_scripted_policy_chat_and_token_mode(servers, tok):
    _, url = servers
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {
        "messages": messages,
        "tools": TOOLS,
        "return_token_ids": True,
        "return_meta_info": True,
        "logprobs": True,
    }
    out = _post(url, "/v1/chat/completions", body).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking the weather."
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {
        "city": "Paris",
        "unit": "celsius",
    }
    assert all(e[0] <= 0 for e in choice["meta_info"]["output_token_logprobs"])
    # Token mode: the same conversation rendered client-side gets the same scripted ids.
    gen = _post(
        url, "/generate", {"input_ids": tok.render_ids(messages, TOOLS), "return_logprob": True}
    ).json()
    assert gen["output_ids"] == choice["token_ids"]
    follow = messages + [
        {
            "role": "assistant",
            "content": "Checking the weather.",
            "tool_calls": choice["message"]["tool_calls"],
        },
        {
            "role": "tool",
            "tool_call_id": choice["message"]["tool_calls"][0]["id"],
            "content": '{"sky": "clear"}',
        },
    ]
    final = _post(url, "/v1/chat/completions", {"messages": follow, "tools": TOOLS}).json()[
        "choices"
    ][0]
    assert (
        final["finish_reason"] == "stop" and final["message"]["content"] == "It is sunny in Paris."
    )


def test_full_queue_answers_503(servers):
    _, url = servers
    assert _post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        queued, box = _in_background(lambda: _post(url, "/generate", {"text": "hello"}))
        _engine_when(url, lambda s: s["waiting"])
        full = _post(url, "/generate", {"text": "hello"})
        assert full.status_code == 503
        assert (
            full.json()["type"] == "ServiceUnavailable"
            and "queue is full" in full.json()["message"]
        )
        assert full.headers["retry-after"] == "1"
    finally:
        _post(url, "/continue_generation")
    queued.join(timeout=30)
    assert box["value"].status_code == 200
    assert box["value"].json()["text"] == "Hello! How can I help?"


def test_client_disconnect_aborts_its_generation(servers):
    url, _ = servers
    body = {
        "input_ids": [7, 8, 9],
        "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True},
    }
    before = httpx.get(url + "/server_info").json()["internal_states"][0]["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/generate", json=body, timeout=0.5)  # gives up and closes the connection
    deadline = time.monotonic() + 10
    while (state := httpx.get(url + "/server_info").json()["internal_states"][0])["running"]:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)
    assert state["generated_tokens"] - before < 20000


def test_a_keyed_server_answers_only_with_its_key(model_dirs):
    """``polar model serve`` with ``POLAR_ENGINE_API_KEY`` (issue 17): the key stays off
    the command line; /health stays open for whoever waits on it."""
    proc, url = _start(model_dirs[0], env={"POLAR_ENGINE_API_KEY": "pe_server-key"})
    try:
        _wait_healthy(proc, url)
        assert "pe_server-key" not in " ".join(proc.args)
        refused = _post(url, "/continue_generation")
        assert refused.status_code == 401 and refused.json()["type"] == "Unauthorized"
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
        keyed = httpx.post(
            url + "/generate", json=body, headers={"authorization": "Bearer pe_server-key"}
        )
        assert keyed.status_code == 200, keyed.text
    finally:
        _stop(proc)
