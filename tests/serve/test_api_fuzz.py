"""Every request the server's own OpenAPI schema allows, and many it does not, gets an answer below 500."""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from linearize.hub import build_tiny_tokenizer
from linearize.serve.api import Limits, create_app

from .test_api import Server, tiny_engine


@pytest.fixture(scope="module")
def api_schema():
    _, engine = tiny_engine("memory")
    engine.config.kv_budget = 400_000  # tight: admission, raises and rejection all get exercised
    server = Server(create_app(engine, build_tiny_tokenizer(), model_name="tiny", limits=Limits(max_prompt_tokens=64, max_tokens_default=8)))
    yield schemathesis.openapi.from_url(server.url + "/openapi.json")
    server.close()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    response = case.call(timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:300]}"
