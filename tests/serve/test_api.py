"""The HTTP API through real HTTP: the official openai client, streaming and not, errors as 4xx."""

import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from linearize.convert import convert, set_active
from linearize.hub import build_tiny_llama, build_tiny_tokenizer
from linearize.serve.api import Limits, create_app
from linearize.serve.engine import Engine, EngineConfig
from linearize.serve.levels import LevelMemory
from linearize.serve.policy import parse_policy
from linearize.spec import ConversionSpec


class Server:
    """A uvicorn server on a free local port, in a thread."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def tiny_engine(policy="static:2"):
    model = build_tiny_llama(0, num_hidden_layers=4)
    spec = ConversionSpec.from_dict({"attention": "dsla", "order": [2, 0, 3, 1]})
    convert(model, spec)
    levels = LevelMemory.from_spec(spec, model.config, dtype_bytes=4)
    return model, Engine(model, levels, EngineConfig(kv_budget=10**9, max_step_tokens=64), policy=parse_policy(policy, levels))


@pytest.fixture(scope="module")
def served():
    model, engine = tiny_engine()
    tokenizer = build_tiny_tokenizer()
    server = Server(create_app(engine, tokenizer, model_name="tiny", limits=Limits(max_prompt_tokens=200)))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield model, engine, tokenizer, server, client
    server.close()


def greedy(model, ids, n, level=2):
    set_active(model, level)
    ids = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def test_completion_matches_greedy_decoding(served):
    model, _, tokenizer, _, client = served
    prompt = [1, 9, 10, 11, 12]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    want = greedy(model, prompt, 6)
    assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 6, 11)


def test_chat_streams_with_usage_and_stops_on_a_string(served):
    model, _, tokenizer, _, client = served
    messages = [{"role": "user", "content": "w20 w21 w22"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    want = greedy(model, ids, 8)
    words = tokenizer.decode(want, skip_special_tokens=True).split()
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].message.content == " ".join(words)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " ".join(words)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == len(ids)
    stop = words[3]
    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == (" ".join(words)).split(stop)[0]


def test_models_health_and_metrics(served):
    _, _, _, server, client = served
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("linearize:num_requests_running", "linearize:time_to_first_token_seconds", "linearize:converted_layers_per_request",
                 "linearize:kv_cache_bytes", "linearize:state_bytes", "linearize:num_preemptions",
                 "linearize:memory_held_budget_fraction"):
        assert name in metrics
    assert 'linearize:converted_layers_per_request_sum{model_name="tiny"}' in metrics


@pytest.mark.parametrize("body,status,fragment", [
    ({"prompt": "w5", "temperature": 5}, 400, "temperature"),
    ({"prompt": "w5", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "w5", "model": "gpt-9"}, 404, "gpt-9"),
    ({"prompt": " ".join(["w7"] * 300)}, 400, "at most 200"),
    ({"prompt": [5, 9000]}, 400, "token id 9000 is out of range: token ids must lie in 0..127"),
    ({"prompt": [5, -1]}, 400, "token id -1"),
    ({"prompt": [5, 1.5]}, 400, "token ids (integers) or one string; found 1.5"),
    ({"prompt": [True, 5]}, 400, "found True"),
    ({"prompt": ["w5", 3]}, 400, "found 'w5'"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": "w5", "n": 2}, 400, "n"),
    ({"prompt": "w5", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({}, 400, "prompt"),
])
def test_bad_completion_requests_get_4xx_with_an_openai_error(served, body, status, fragment):
    server = served[3]
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]


def test_bad_chat_and_malformed_json(served):
    server = served[3]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_openai_client_raises_typed_errors(served):
    client = served[4]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="w5", temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="w5")


def test_a_client_that_disconnects_frees_its_request(served):
    _, engine, _, server, _ = served
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "w5 w6", "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    for _ in range(100):
        if not engine.running and not engine.waiting:
            break
        time.sleep(0.05)
    assert not engine.running and not engine.waiting
    assert any(r.finish_reason == "abort" for r in engine.finished.values())


def test_api_key_is_required_when_set():
    _, engine = tiny_engine()
    server = Server(create_app(engine, build_tiny_tokenizer(), model_name="tiny", api_key="sekrit"))
    try:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.close()


@pytest.mark.slow
def test_serve_command_answers_a_chat_on_the_real_model():
    """`linearize serve --model smollm2-135m-dsla-chained` as a user runs it: a chat through the openai
    client over HTTP, and /metrics shows the level the request ran at."""
    import socket
    import subprocess
    import sys

    from linearize.hub import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "linearize.cli", "serve", "--model", "smollm2-135m-dsla-chained", "--port", str(port),
                             "--policy", "static:8", "--kv-budget", "256MiB", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="smollm2-135m-dsla-chained", temperature=0, max_tokens=12,
                                             messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in out.choices[0].message.content
        metrics = httpx.get(url + "/metrics").text
        assert 'linearize:converted_layers_per_request_sum{model_name="smollm2-135m-dsla-chained"} 8.0' in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=30)
