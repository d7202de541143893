"""Trace replay against a real server over HTTP, the random system-scale families, and the warm-up."""

import json

import httpx
import pytest
import torch

from linearize.hub import build_tiny_tokenizer
from linearize.serve.api import HELD_BUCKETS, Limits, create_app
from linearize.serve.client import HTTPReplay, _held_bounds, scrape
from linearize.serve.random_family import SHAPES, build_random_family, dsla_spec, random_shape
from linearize.serve.replay import ReplayRequest, summarize, warm_up, warm_up_levels
from linearize.serve.server import build_app, load_family
from linearize.serve.settings import ReplaySettings, ServeSettings

from .test_api import Server, tiny_engine


@pytest.fixture(scope="module")
def random_server():
    """`linearize serve --model random:tiny --policy static:2` (build_app + uvicorn) on a free port."""
    app, engine = build_app(ServeSettings(model="random:tiny", device="cpu", policy="static:2", kv_budget="64MiB"))
    server = Server(app)
    yield server, engine
    server.close()


def test_replay_against_a_server_accounts_for_every_request(random_server, tmp_path):
    """`linearize replay --url` on 6 requests of the shipped code trace: each one completes with the
    token count it asked for, TTFT <= E2E, the report names the server's policy and counts."""
    from linearize.cli import main

    server, engine = random_server
    before = len(engine.finished)
    assert main(["replay", "--url", server.url, "--model", "random:tiny", "--trace", "azure-code", "--start", "588", "--requests", "6",
                 "--max-prompt", "512", "--rate-scale", "20", "--out", str(tmp_path)]) == 0  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["policies"]) == ["static:2"] and report["settings"]["server"] == server.url
    m = report["policies"]["static:2"]
    assert (m["requests"], m["completed"], m["rejected"], m["lost"], m["statuses"]) == (6, 6, 0, 0, {"ok": 6})
    assert m["mean_level"] == 2.0 and m["budget_bytes"] == 64 * 2**20 and 0 <= m["peak_bytes"] <= m["budget_bytes"]  # sampled
    lo, hi = m["peak_budget_fraction_bounds"]  # every step, from the server's histogram: some held memory, none over budget
    assert 0 <= lo < hi <= 1 and m["peak_bytes"] <= hi * m["budget_bytes"]
    assert m["server"]["policy"] == "static:2" and m["preemptions"] == 0
    records = report["raw"]["static:2"]["records"]
    assert [r["output_tokens"] for r in records] == [9, 10, 14, 6, 18, 12]  # the trace's GeneratedTokens
    for r in records:
        assert r["status"] == "ok" and r["generated"] == r["output_tokens"]
        ttft, e2e = r["token_times"][0] - r["arrival"], r["finish"] - r["arrival"]
        assert 0 < ttft <= e2e
    assert len(engine.finished) - before >= 6 + 1  # the timed requests and at least one warm-up request
    for name in ("report.json", "report.md", "latency_cdf.png", "latency_vs_length.png", "memory_levels.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| static:2 | 6 | 0 | 0 |" in (tmp_path / "report.md").read_text()


def test_refused_and_timed_out_requests_keep_their_status():
    """Prompts over the server's limit come back as 'http 400', a request still to come when the
    run's time is up as 'timeout'; none is lost from the count."""
    _, engine = tiny_engine()
    server = Server(create_app(engine, build_tiny_tokenizer(), model_name="tiny", limits=Limits(max_prompt_tokens=40)))
    try:
        requests = [ReplayRequest(0.0, [5] * 20, 3, 0, 0), ReplayRequest(0.0, [6] * 60, 3, 1, 0), ReplayRequest(0.01, [7] * 30, 4, 2, 0),
                    ReplayRequest(60.0, [8] * 10, 3, 3, 0)]  # fmt: skip
        client = HTTPReplay(server.url, requests, timeout=4.0, warm_up=(), progress=False)
        assert client.connect() == {"model_name": "tiny", "policy": "static:2"} and client.model == "tiny"
        records, timeline, counted = client.run()
    finally:
        server.close()
    assert [r.status for r in records] == ["ok", "http 400", "ok", "timeout"]
    assert "at most 40" in records[1].detail
    assert [r.generated for r in records[::2]] == [3, 4]
    m = summarize(records)
    assert (m["completed"], m["rejected"], m["lost"], m["statuses"]) == (2, 1, 1, {"http 400": 1, "ok": 2, "timeout": 1})
    assert counted["mean_level"] == 2.0 and counted["server"]["policy"] == "static:2"


def test_a_wrong_url_or_model_name_fails_clearly():
    with pytest.raises(ValueError, match="no server answers"):
        HTTPReplay("http://127.0.0.1:9", [], progress=False).connect()
    with pytest.raises(ValueError, match="url 'localhost:8000'"):
        ReplaySettings(url="localhost:8000")
    with pytest.raises(ValueError, match="a server runs one policy"):
        ReplaySettings(url="http://localhost:8000", policies="softmax,memory")


def test_metrics_scrape_reads_the_engine_info_and_counters(random_server):
    server, _ = random_server
    m = scrape(httpx.get(server.url + "/metrics").text)
    assert m["info"] == {"model_name": "random:tiny", "policy": "static:2"}
    assert {"linearize:num_preemptions_total", "linearize:conversions_total", "linearize:memory_peak_bytes"} <= set(m)


def test_random_families():
    assert (SHAPES["llama2-7b"].layers, SHAPES["llama2-7b"].hidden, SHAPES["llama2-7b"].heads, SHAPES["llama2-7b"].kv_heads,
            SHAPES["llama2-7b"].intermediate, SHAPES["llama2-7b"].vocab) == (32, 4096, 32, 32, 11008, 32000)  # fmt: skip
    a, tokenizer = build_random_family("random:tiny", "cpu", seed=3)
    b, _ = build_random_family("random:tiny", "cpu", seed=3)
    c, _ = build_random_family("random:tiny", "cpu", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert {p.dtype for p in a.parameters()} == {torch.float32}
    assert a.config.linearize["order"] == [0, 1, 2, 3] and a.config.linearize["options"]["linear_rope"] is False
    assert dsla_spec(4)["attention"] == "dsla"
    assert tokenizer("w5 w17")["input_ids"] == [5, 17] and len(tokenizer) == 128
    with pytest.raises(ValueError, match="random:nope.*random:tiny, random:llama2-7b"):
        random_shape("random:nope")
    with pytest.raises(ValueError, match="random:llama2-7b"):
        ServeSettings(model="random:7b")


def test_llama2_7b_builds_on_the_meta_device():
    """Its shape without allocating 13 GB: Llama-2-7B's 6.74B parameters plus the DSLA modules'."""
    model, tokenizer = build_random_family("random:llama2-7b", "meta")
    n = sum(p.numel() for p in model.parameters())
    assert 6_738_415_616 < n < 6_738_415_616 * 1.01
    assert model.model.layers[31].self_attn.q_proj.weight.shape == (4096, 4096) and model.lm_head.weight.shape == (32000, 4096)
    assert len(tokenizer) == 32000


def test_warm_up_prefills_and_decodes_at_level_zero_the_middle_and_the_top():
    _, engine = tiny_engine("memory")
    calls = []
    forward = engine.runner.forward

    def spy(seqs, ids):
        calls.append((tuple(s.level for s in seqs), ids.shape[1]))
        return forward(seqs, ids)

    engine.runner.forward = spy
    assert warm_up(engine, list(range(3, 100)), lengths=(10, 40)) == [0, 2, 4]
    for level in (0, 2, 4):
        assert any(level in levels and t > 1 for levels, t in calls), f"no prefill at level {level}"
        assert any(levels == (level, level) and t == 1 for levels, t in calls), f"no batched decode at level {level}"
    assert not engine.finished and not engine.counters and str(engine.policy) == "memory"
    assert warm_up_levels(engine.runner.model, engine.levels, max_level=3, lengths=(10,)) == [0, 1, 3]


@pytest.mark.slow
def test_replay_command_on_the_random_family(tmp_path):
    """The CPU stand-in of `linearize replay --model random:llama2-7b --device cuda --kv-budget 34GiB`:
    the random family loads, warms up and replays in process under two policies."""
    from linearize.cli import main

    assert main(["replay", "--model", "random:tiny", "--device", "cpu", "--kv-budget", "64MiB", "--trace", "azure-code", "--start", "588",
                 "--requests", "5", "--max-prompt", "256", "--rate-scale", "20", "--policies", "softmax,memory",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["policies"]) == {"softmax", "memory"}
    assert all((m["completed"], m["lost"]) == (5, 0) for m in report["policies"].values())


def test_load_family_builds_the_random_family():
    model, tokenizer, levels, device = load_family(ServeSettings(model="random:tiny", device="cpu"))
    assert levels.order == (0, 1, 2, 3) and device.type == "cpu" and len(tokenizer) == model.config.vocab_size


def test_the_api_key_is_sent():
    _, engine = tiny_engine()
    server = Server(create_app(engine, build_tiny_tokenizer(), model_name="tiny", api_key="sekrit"))
    try:
        with pytest.raises(ValueError, match="answered 401"):
            HTTPReplay(server.url, [], progress=False).connect()
        client = HTTPReplay(server.url, [ReplayRequest(0.0, [5] * 8, 2, 0, 0)], api_key="sekrit", warm_up=(), progress=False)
        client.connect()
        records, _, _ = client.run()
    finally:
        server.close()
    assert [(r.status, r.generated) for r in records] == [("ok", 2)]


def test_held_bounds_bracket_the_most_any_step_held_between_two_scrapes():
    """Steps observed before the first scrape do not count; the bucket of the largest later step does."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    held = Histogram("linearize:memory_held_budget_fraction", "held", registry=registry, buckets=HELD_BUCKETS)
    held.observe(0.97)
    before = scrape(generate_latest(registry).decode())
    assert _held_bounds(before, before) is None  # no step between them
    for x in (0.0, 0.12, 0.31, 0.02):
        held.observe(x)
    after = scrape(generate_latest(registry).decode())
    assert _held_bounds(before, after) == [0.3, 0.35]
    held.observe(5.0)
    assert _held_bounds(after, scrape(generate_latest(registry).decode())) == [4.0, None]
    idle = scrape(generate_latest(registry).decode())
    held.observe(0.0)
    assert _held_bounds(idle, scrape(generate_latest(registry).decode())) == [0.0, 0.0]
