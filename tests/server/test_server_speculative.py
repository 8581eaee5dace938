"""``serve --speculative-config``: responses through the ``openai`` client are bitwise those of the
same server without speculation (text, tokens, logprobs, top logprobs; greedy and seeded, n > 1),
and /metrics counts the proposals (vLLM's spec_decode_* names). A config the engine refuses is
refused by ``Engine`` (tests/engine/test_speculative.py) before the server listens."""
from __future__ import annotations

import json

import openai
import pytest

from helpers.servers import KEY, MODEL, ServerProcess
from invariant_infer.cli.serve import main as serve_main

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.fixture(scope="module")
def speculative_server(checkpoint, tmp_path_factory):
    """The shared server's options, speculating."""
    s = ServerProcess(["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "fp32", "--api-key", KEY,
                       "--max-num-seqs", "4", "--speculative-config", json.dumps(SPECULATIVE)],
                      tmp_path_factory.mktemp("serve-spec-log") / "server.log")
    yield s
    s.stop()


def answers(client, **request):
    out = client.completions.create(model=MODEL, prompt="the cat runs fast the cat runs fast the cat", max_tokens=12,
                                    logprobs=2, **request)
    return [(c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs, c.finish_reason)
            for c in sorted(out.choices, key=lambda c: c.index)]


@pytest.mark.heavy
def test_speculation_through_the_server_equals_plain_serving(client, speculative_server):
    spec_client = openai.OpenAI(base_url=speculative_server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    for request in ({"temperature": 0}, {"temperature": 0.8, "seed": 3, "n": 2}):
        assert answers(spec_client, **request) == answers(client, **request)
    metrics = speculative_server.metrics()
    drafts, proposed = metrics["invariant_infer_spec_decode_num_drafts_total"], \
        metrics["invariant_infer_spec_decode_num_draft_tokens_total"]
    accepted = metrics["invariant_infer_spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and proposed >= drafts and 0 <= accepted <= proposed
    assert metrics["invariant_infer_spec_decode_mean_acceptance_length"] == 1 + accepted / drafts


def test_speculative_config_must_be_a_json_object(capsys):
    for text in ("{nope", "[1, 2]"):
        with pytest.raises(SystemExit) as exit_info:
            serve_main(["--model", "unused", "--speculative-config", text])
        assert exit_info.value.code == 2 and "--speculative-config" in capsys.readouterr().err


def test_a_speculative_config_the_engine_refuses_stops_the_start_with_its_reason(checkpoint, capsys):
    """Refused before the server listens: exit status 2 and the engine's reason, no traceback."""
    bad = json.dumps({"method": "eagle", "num_speculative_tokens": 2})
    assert serve_main(["--model", str(checkpoint), "--dtype", "fp32", "--port", "0", "--speculative-config", bad]) == 2
    err = capsys.readouterr().err
    assert "speculative method must be one of" in err and "Traceback" not in err
