"""Scale-out: two Ray Serve replicas of a tiny nested family behind one OpenAI endpoint, on CPU."""

import socket
import time

import httpx
import openai
import pytest

from linearize.convert import convert
from linearize.hub import build_tiny_llama, build_tiny_tokenizer
from linearize.serve.settings import ServeSettings
from linearize.spec import ConversionSpec

pytestmark = pytest.mark.slow  # starts a Ray cluster


def test_two_replicas_answer_behind_one_endpoint(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from ray import serve

    from linearize.serve.server import ray_application

    # Ray Serve gives its HTTP proxy 5 s to report ready (three misses and it is restarted): on a loaded
    # 2-core machine that start alone can take longer. The processes Ray starts inherit these.
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    model = build_tiny_llama(0, num_hidden_layers=4)
    convert(model, ConversionSpec.from_dict({"attention": "dsla", "order": [2, 0, 3, 1]}))
    model.save_pretrained(tmp_path / "tiny")
    build_tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = ServeSettings(model=str(tmp_path / "tiny"), served_model_name="tiny", port=port, replicas=2, device="cpu",
                             kv_budget="64MiB", policy="static:2")  # fmt: skip
    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_application(settings), name="linearize", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        texts = {client.completions.create(model="tiny", prompt="w9 w10 w11", max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for _ in range(6)}  # fmt: skip
        assert len(texts) == 1 and texts.pop()  # both replicas run the same weights: the same greedy text
        pids = set()
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            pids.add(httpx.get(url + "/health", timeout=10).json()["pid"])
        assert len(pids) == 2  # two engines, each in its own replica process
    finally:
        serve.shutdown()
        ray.shutdown()
