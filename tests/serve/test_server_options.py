"""How `pagedkv serve` is set up rather than what it answers: the API key,
the names the model is served as, the origins browser pages may call it
from."""

from __future__ import annotations

import httpx
import openai
import pytest
from chat_server import MODEL, openai_client

from pagedkv.models import load
from pagedkv.serve import ServerThread

WARM_GRAPHS = ("smollm2-gguf",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""


@pytest.fixture(scope="module")
def llm():
    return load(MODEL)


def test_api_key(llm):
    with ServerThread(llm, api_key="sesame") as s:
        with pytest.raises(openai.AuthenticationError):
            openai_client(s).models.list()
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0)
        assert [m.id for m in good.models.list()] == [MODEL]
        assert httpx.get(s.url + "/health").status_code == 200


def test_served_model_names(llm):
    """vLLM's --served-model-name: requests may name the model by any of its
    names, answers echo the one named, /v1/models lists them all."""
    names = ["gpt-4o-mini", MODEL]
    with ServerThread(llm, served_model_names=names) as s:
        c = openai_client(s)
        assert [m.id for m in c.models.list()] == names
        r = c.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert r.model == "gpt-4o-mini"
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).model == MODEL
        r = httpx.post(s.url + "/v1/completions", json={"model": "other", "prompt": "hi"})
        assert r.status_code == 404 and "gpt-4o-mini" in r.json()["error"]["message"]


def test_allowed_origins(llm):
    """CORS: a named origin's browser preflight and answers pass, another's
    do not; without the flag no origin is allowed."""
    page = "http://localhost:3000"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST"}
    with ServerThread(llm, allowed_origins=[page]) as s:
        r = httpx.options(s.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = httpx.get(s.url + "/v1/models", headers={"Origin": page})
        assert r.headers["access-control-allow-origin"] == page
        deleting = {**preflight, "Access-Control-Request-Method": "DELETE"}
        assert httpx.options(s.url + "/v1/responses/x", headers=deleting).status_code == 200
        other = {**preflight, "Origin": "http://elsewhere.example"}
        assert httpx.options(s.url + "/v1/chat/completions", headers=other).status_code == 400
    with ServerThread(llm) as s:
        r = httpx.get(s.url + "/v1/models", headers={"Origin": page})
        assert "access-control-allow-origin" not in r.headers


def test_reasoning_format_flag_and_a_stored_responses_bound():
    """--reasoning-format parses into the serve command (run_serve passes it to
    `load`; its effect is tested in test_reasoning.py); a bound of stored
    responses under 1 is refused before the model loads."""
    from pagedkv.cli.main import _parser
    from pagedkv.serve.cli import run_serve

    assert run_serve(_parser().parse_args(["serve", "--max-stored-responses", "0"])) == 2

    assert _parser().parse_args(["serve"]).reasoning_format == "auto"
    assert _parser().parse_args(["serve", "--reasoning-format", "none"]).reasoning_format == "none"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--reasoning-format", "deepseek"])


@pytest.mark.parametrize("seconds", ["-1", "nan", "inf"])
def test_a_shutdown_timeout_that_is_not_a_time_is_refused_before_the_model_loads(seconds, capsys):
    from pagedkv.cli.main import _parser
    from pagedkv.serve.cli import run_serve

    assert run_serve(_parser().parse_args(["serve", "--shutdown-timeout", seconds])) == 2
    assert "--shutdown-timeout must be a number of seconds" in capsys.readouterr().err
