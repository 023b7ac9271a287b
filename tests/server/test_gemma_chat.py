"""The server serves Gemma-2 and Gemma-3 directories with Gemma's chat formats: the openai SDK
gets a chat reply equal to HF transformers' greedy continuation of the prompt HF's own
tokenizer renders (the reply longer than the model's window); a Gemma-2 template's refusal of a
system message is a 400, not a dead request, and Gemma-3's folds it into the first turn."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from helpers.hf_models import (
    GEMMA2_CHAT_TEMPLATE,
    GEMMA3_CHAT_TEMPLATE,
    GEMMA_EOS_IDS,
    build_tokenizer,
    hf_greedy,
)
from helpers.server import serving, tiny_app

pytestmark = pytest.mark.spawns

TEMPLATES = {"gemma2": GEMMA2_CHAT_TEMPLATE, "gemma3": GEMMA3_CHAT_TEMPLATE}
MESSAGES = [{"role": "user", "content": "Paged attention keeps the KV cache in blocks."},
            {"role": "assistant", "content": "Like pages of memory."},
            {"role": "user", "content": "And continuous batching?"}]
NUM_NEW = 24  # windows are 8-10 tokens


@pytest.fixture(scope="module", params=list(TEMPLATES))
def chat_model(request, sliding_dir_factory, tmp_path_factory):
    """A copy of the tiny model with Gemma's special tokens, chat template and EOS ids."""
    out = tmp_path_factory.mktemp(request.param) / "model"
    shutil.copytree(sliding_dir_factory(request.param), out)
    build_tokenizer(out, vocab_size=512, chat_template=TEMPLATES[request.param])
    generation = {"bos_token_id": 2, "eos_token_id": GEMMA_EOS_IDS, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(generation))
    return request.param, out


@pytest.fixture(scope="module")
def client(chat_model):
    with serving(tiny_app(chat_model[1])) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_a_chat_reply_is_hf_greedy_on_hf_rendered_prompt(chat_model, client):
    from transformers import AutoTokenizer

    name, model_dir = chat_model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = MESSAGES
    if name == "gemma3":  # a system message and list content, folded by the template
        messages = [{"role": "system", "content": "Be brief."},
                    {**MESSAGES[0], "content": [{"type": "text", "text": MESSAGES[0]["content"]}]},
                    *MESSAGES[1:]]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    assert prompt[0] == 2 and prompt[1] == 3  # <bos><start_of_turn>
    expected = hf_greedy(model_dir, [prompt], NUM_NEW, eos_token_id=GEMMA_EOS_IDS)[0]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=NUM_NEW,
                                           temperature=0)
    choice = reply.choices[0]
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(expected)
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if len(expected) == NUM_NEW else "stop")


def test_a_system_message_is_refused_by_gemma2_and_folded_in_by_gemma3(chat_model, client):
    messages = [{"role": "system", "content": "Be brief."}, MESSAGES[0]]
    if chat_model[0] == "gemma3":
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        assert reply.choices[0].message.content is not None
        return
    with pytest.raises(openai.BadRequestError, match="System role not supported"):
        client.chat.completions.create(model="tiny", max_tokens=4, messages=messages)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES[:1], max_tokens=4)
    assert reply.choices[0].message.content is not None  # the engine still serves
