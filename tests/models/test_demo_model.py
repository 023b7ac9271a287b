"""The built-in demo model (`aserve/assets/aserve-demo/`): `LLM()` with no model serves it, it
answers greetings from its training corpus in dictionary words, and HF transformers loads the same
directory and gives the same greedy reply token for token (float32)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.hf_models import hf_greedy, load_hf_model

from aserve import LLM, SamplingParams
from aserve.assets import DEMO_MODEL_DIR, DEMO_MODEL_NAME

# First turns of chatterbot-corpus dialogues (greetings.yml, conversations.yml, botprofile.yml).
GREETINGS = ["Hello", "Hi", "How are you doing?", "Good morning, how are you?", "Where are you"]
# Written by the trainer (scripts/train_demo_model.py --words-out).
WORDS_FILE = Path(__file__).resolve().parents[1] / "data" / "demo_corpus_words.txt"
MAX_TOKENS = 32
MIN_WORD_FRACTION = 0.7
WORD = re.compile(r"[A-Za-z']+")
SMALL_CACHE = dict(num_kv_blocks=64)  # 1,024 token slots: plenty, and no 2 GiB default cache


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def greedy_replies(llm: LLM) -> list:
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(chat(g), add_generation_prompt=True)
               for g in GREETINGS]
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))


def word_fraction(reply: str, vocabulary: set[str]) -> float:
    words = [w.strip("'").lower() for w in WORD.findall(reply)]
    words = [w for w in words if w]
    return sum(w in vocabulary for w in words) / max(1, len(words))


@pytest.fixture(scope="module")
def vocabulary() -> set[str]:
    return set(WORDS_FILE.read_text().split())


@pytest.fixture(scope="module")
def fp32_outputs():
    return greedy_replies(LLM(dtype="float32", **SMALL_CACHE))


def test_demo_model_dir_ships_a_small_hf_directory():
    names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json", "MODEL_CARD.md"}
    assert names <= {p.name for p in DEMO_MODEL_DIR.iterdir()}
    assert sum(p.stat().st_size for p in DEMO_MODEL_DIR.rglob("*") if p.is_file()) < 10 * 2**20
    tokenizer_config = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] in ("bfloat16", "float16")


def test_llm_without_a_model_serves_the_demo_under_a_stable_name():
    llm = LLM(**SMALL_CACHE)
    assert llm.engine_args.model == str(DEMO_MODEL_DIR)
    assert llm.engine_args.served_model_name == DEMO_MODEL_NAME == "aserve-demo"


def test_demo_model_answers_greetings_in_corpus_words(fp32_outputs, vocabulary):
    for greeting, out in zip(GREETINGS, fp32_outputs):
        reply = out.outputs[0].text
        assert WORD.search(reply), (greeting, reply)
        assert word_fraction(reply, vocabulary) >= MIN_WORD_FRACTION, (greeting, reply)
        assert out.outputs[0].finish_reason == "stop", (greeting, reply)  # ends with <|im_end|>


def test_demo_model_answers_in_words_in_its_shipped_dtype(vocabulary):
    """The default dtype ("auto": bfloat16 from config.json) is what `python -m aserve` runs."""
    for greeting, out in zip(GREETINGS, greedy_replies(LLM(**SMALL_CACHE))):
        reply = out.outputs[0].text
        assert WORD.search(reply), (greeting, reply)
        assert word_fraction(reply, vocabulary) >= MIN_WORD_FRACTION, (greeting, reply)


def test_transformers_loads_the_demo_dir_and_gives_the_same_greedy_reply(fp32_outputs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model = load_hf_model(DEMO_MODEL_DIR)
    for greeting, out in zip(GREETINGS, fp32_outputs):
        text = tokenizer.apply_chat_template(chat(greeting), tokenize=False,
                                             add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert prompt_ids == out.prompt_token_ids
        [generated] = hf_greedy(model, [prompt_ids], MAX_TOKENS,
                                eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
        assert generated == out.outputs[0].token_ids, greeting
