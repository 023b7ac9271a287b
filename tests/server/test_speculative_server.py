"""A server with n-gram drafts: streamed greedy completions equal the non-speculative ones,
/metrics counts drafts under vLLM's names (per position too), and the dashboard shows the
acceptance rate and the tokens a verifying step gives."""

from __future__ import annotations

import httpx
import openai
from helpers.server import serving, tiny_app

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
PROMPT = [100, 200, 300] * 4  # repeats itself: drafts from the start (and the reply repeats)


def completions(url: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40,
                                      temperature=0.0, extra_body={"ignore_eos": True})
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40,
                                         temperature=0.0, stream=True,
                                         extra_body={"ignore_eos": True})
    return [plain.choices[0].text, "".join(c.choices[0].text for c in streamed)]


def test_served_drafts_change_no_token_and_are_counted(model_dir_factory) -> None:
    model_dir = model_dir_factory("llama")
    with serving(tiny_app(model_dir)) as url:
        expected = completions(url)
    with serving(tiny_app(model_dir, speculative_config=NGRAM)) as url:
        assert completions(url) == expected
        text = httpx.get(f"{url}/metrics").text
        dashboard = httpx.get(f"{url}/dashboard/stats").json()
    counters = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("aserve:spec_decode") and "position" not in line}
    assert counters["aserve:spec_decode_num_drafts_total"] > 0
    accepted = counters["aserve:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= counters["aserve:spec_decode_num_draft_tokens_total"]
    per_pos = 'aserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position='
    assert f'{per_pos}"0"}}' in text
    assert 0 < dashboard["spec_acceptance_rate"] <= 1  # the dashboard's figures
    assert 1 < dashboard["spec_mean_accepted_length"]
