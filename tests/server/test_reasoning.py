"""Reasoning output: `--reasoning-parser` (deepseek_r1, qwen3) splits `<think>...</think>`
into `message.reasoning_content`, streamed as `delta.reasoning_content` in pieces that
concatenate to the whole reply's; a structured-output constraint starts after the reasoning.
"""

from __future__ import annotations

import random
import re

import pytest
from helpers.server import serving, tiny_app

from aserve import LLM, SamplingParams
from aserve.sampling_params import StructuredOutputsParams
from aserve.server import ServerConfig
from aserve.server.reasoning_parsers import (
    StreamingReasoning,
    get_reasoning_parser,
    thinking_ended,
)

CASES = [  # parser, reply, reasoning, content
    ("deepseek_r1", "Let me see. 2+2=4.</think>The answer is 4.", "Let me see. 2+2=4.",
     "The answer is 4."),
    ("deepseek_r1", "<think>Hmm.</think>Four.", "Hmm.", "Four."),
    ("deepseek_r1", "Still thinking when cut off", "Still thinking when cut off", ""),
    ("qwen3", "<think>Short.</think>\n\nFour.", "Short.", "\n\nFour."),
    ("qwen3", "Four, without thinking.", "", "Four, without thinking."),
]


@pytest.mark.parametrize("name, reply, reasoning, content", CASES)
def test_reasoning_parsers_split_whole_and_streamed_replies(name, reply, reasoning, content):
    parser = get_reasoning_parser(name)
    parsed = parser.parse(reply, final=True)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(reply)), 5))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
        stream, got = StreamingReasoning(parser), ["", ""]
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=i == len(pieces) - 1)
            got[0] += r
            got[1] += c
        assert got == [reasoning, content]


def test_a_prompt_that_closes_the_reasoning_ends_it():
    assert thinking_ended("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not thinking_ended("<|im_start|>assistant\n<think>\n")
    assert not thinking_ended("no tags at all")


THINK_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                  "<think></think>")  # the prompt closes thinking: a constraint applies at once


def test_served_reasoning_content_streamed_and_not(llama_dir):
    from openai import OpenAI

    config = ServerConfig(served_model_name="tiny", reasoning_parser="qwen3",
                          trust_request_chat_template=True)
    forced = r"<think>Deep (thought|idea)\.</think>The answer is [0-9]\."
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Why?"}],
                  temperature=1.0, seed=2, max_tokens=120,
                  extra_body={"structured_outputs": {"regex": forced},
                              "chat_template": THINK_TEMPLATE})
    with serving(tiny_app(llama_dir, config)) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        message = client.chat.completions.create(**kwargs).choices[0].message
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert re.fullmatch(r"Deep (thought|idea)\.", message.reasoning_content)
    assert re.fullmatch(r"The answer is [0-9]\.", message.content)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content


def test_a_constraint_starts_after_its_marker(llama_dir):
    """Free text until the marker (here forced by a logit bias), the regex from there on."""
    llm = LLM(llama_dir, dtype="float32")
    marker = llm.tokenizer.token_to_id("Q")
    spec = StructuredOutputsParams(regex="[0-9]{3}", start_after="Q")
    out = llm.generate(["Go:"], SamplingParams(temperature=1.0, seed=0, max_tokens=20,
                                               logit_bias={marker: 50.0},
                                               structured_outputs=spec))[0].outputs[0]
    assert re.fullmatch("Q[0-9]{3}", out.text), out.text
