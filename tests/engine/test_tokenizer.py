"""`Tokenizer` gives what transformers' AutoTokenizer gives on the same directory: encode, decode,
special ids and chat templates, over the config shapes HF model directories use."""

from __future__ import annotations

import json
import pathlib
import random
import shutil

import jinja2
import pytest
from helpers.hf_models import BOS_ID, EOS_ID, PAD_ID

from aserve.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "Hello, world!",
    "Emoji 😀🎉👍🏽 and ❤️ hearts",
    "中文文本测试：你好，世界！",
    "日本語とEnglishと한국어 mixed",
    "Ünïcödé äccents: café, naïve, Zürich.",
    "  leading and trailing spaces  ",
    "tabs\tand\n\nnewlines\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "text<|im_end|>glued<|im_start|>",
    "unseen: Ωμέγα ✓ 🦜 𝔘𝔫𝔦",
]

MESSAGES = [
    [{"role": "user", "content": "Hi 😀"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "中文?"},
     {"role": "assistant", "content": "好。"}, {"role": "user", "content": "  spaces \n"}],
]


def variant(src: pathlib.Path, dst: pathlib.Path, config: dict | None = None,
            drop: tuple[str, ...] = (), files: dict[str, str] | None = None) -> pathlib.Path:
    """A copy of `src` with tokenizer_config.json keys updated or dropped and files written."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config or {})
    for key in drop:
        cfg.pop(key, None)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, text in (files or {}).items():
        (dst / name).write_text(text)
    return dst


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(tok, hf, text, add_special_tokens):
    expected = hf(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert tok.encode(text, add_special_tokens=add_special_tokens) == expected


def test_encode_batch_equals_encode_one_by_one(tok):
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers(tok, hf, skip_special_tokens):
    rng = random.Random(0)
    sequences = [tok.encode(t) for t in TEXTS]
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
                  for _ in range(300)]
    for ids in sequences:
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids


def test_decode_round_trips_text(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_convert_ids_to_tokens_equals_transformers(tok, hf):
    ids = tok.encode(TEXTS[2] + TEXTS[8])
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])


def test_special_ids_vocab_size_and_max_length(tok, hf):
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert tok.pad_token_id == hf.pad_token_id
    assert tok.all_special_ids == hf.all_special_ids
    assert tok.vocab_size == len(hf) == 512
    assert tok.model_max_length == hf.model_max_length == 2048
    assert tok.eos_token_ids == (EOS_ID,)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_template_equals_transformers(tok, hf, messages, add_generation_prompt):
    expected = hf.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    result = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert result == expected


def test_chat_template_sees_special_tokens_kwargs_and_hf_helpers(tok, hf):
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m | tojson }}{% if m.get('reasoning_content') %}[{{ m.reasoning_content }}]{% endif %}"
        "{% endfor %}{{ ns.n }} {{ extra }} {{ dict(a=1) | tojson }} {{ strftime_now('%Y')[:2] }}"
        "{{ eos_token }}")
    messages = [{"role": "user", "content": "héllo <b> 😀", "name": None},
                {"role": "assistant", "content": "ok", "reasoning": "think"}]
    kwargs = dict(chat_template=template, add_generation_prompt=False, extra="X")
    expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert tok.apply_chat_template(messages, **kwargs) == expected
    assert "<b>" in expected and "None" not in expected and "[think]" in expected


def test_chat_template_raise_exception_and_sandbox(tok):
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        tok.apply_chat_template(MESSAGES[0], chat_template="{{ raise_exception('no system') }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(MESSAGES[0], chat_template="{{ messages.append(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(MESSAGES[0],
                                chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")


def test_chat_template_generation_tag_renders_its_body(tok):
    template = "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}" \
               "{% endfor %}"
    assert tok.apply_chat_template(MESSAGES[0], chat_template=template) == "<Hi 😀>"


def test_empty_messages_raise(tok):
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])


def test_no_chat_template_raises_clear_error(model_dir, tmp_path):
    tok = Tokenizer.from_dir(variant(model_dir, tmp_path / "m", drop=("chat_template",)))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES[0])
    assert tok.apply_chat_template(MESSAGES[0], chat_template="{{ messages[0].content }}") \
        == "Hi 😀"


def test_missing_tokenizer_json_names_file_and_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*empty_model"):
        Tokenizer.from_dir(tmp_path / "empty_model")


def test_named_chat_templates_pick_default_or_tool_use(model_dir, hf, tmp_path):
    templates = [{"name": "default", "template": "D{{ messages | length }}"},
                 {"name": "tool_use", "template": "T{{ tools | tojson }}"}]
    path = variant(model_dir, tmp_path / "m", config={"chat_template": templates})
    tok = Tokenizer.from_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    tools = [{"type": "function", "function": {"name": "f"}}]
    for kwargs in ({}, {"tools": tools}, {"chat_template": "tool_use"}):
        expected = ref.apply_chat_template(MESSAGES[1], tokenize=False, **kwargs)
        assert tok.apply_chat_template(MESSAGES[1], **kwargs) == expected
    assert tok.apply_chat_template(MESSAGES[1]) == "D4"


def test_chat_template_jinja_file_overrides_config(model_dir, tmp_path):
    path = variant(model_dir, tmp_path / "m", files={"chat_template.jinja": "F{{ bos_token }}"})
    tok = Tokenizer.from_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    expected = ref.apply_chat_template(MESSAGES[0], tokenize=False)
    assert tok.apply_chat_template(MESSAGES[0]) == expected == "F<|im_start|>"


def test_config_variants_equal_transformers(model_dir, tmp_path):
    """Special tokens as AddedToken dicts, a special token missing from the vocab, add_bos_token
    set (transformers v5 ignores it when tokenizer.json exists), no model_max_length."""
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False},
        "mask_token": "<mask>",
        "add_bos_token": True,
        "add_eos_token": True,
    }
    path = variant(model_dir, tmp_path / "m", config=config, drop=("model_max_length",))
    tok = Tokenizer.from_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.vocab_size == len(ref) == 513
    assert tok.all_special_ids == ref.all_special_ids
    assert tok.bos_token_id == ref.bos_token_id == BOS_ID
    assert tok.model_max_length is None
    for text in [*TEXTS, "a <mask> b"]:
        assert tok.encode(text) == ref(text)["input_ids"]
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_bos_from_tokenizer_json_post_processor(model_dir, tmp_path):
    """A TemplateProcessing post-processor in tokenizer.json adds BOS whatever the config says."""
    path = variant(model_dir, tmp_path / "m", config={"add_bos_token": False})
    data = json.loads((path / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [BOS_ID],
                                            "tokens": ["<|im_start|>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(data))
    tok = Tokenizer.from_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert tok.encode(text) == ref(text)["input_ids"]
        assert tok.encode(text)[0] == BOS_ID
        assert tok.encode(text, add_special_tokens=False) == \
            ref(text, add_special_tokens=False)["input_ids"]


def test_special_tokens_map_and_generation_config(model_dir, tmp_path):
    special_map = {"eos_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                                 "rstrip": False, "single_word": False}}
    files = {"special_tokens_map.json": json.dumps(special_map),
             "generation_config.json": json.dumps({"eos_token_id": [PAD_ID, EOS_ID]})}
    path = variant(model_dir, tmp_path / "m", drop=("added_tokens_decoder",), files=files)
    tok = Tokenizer.from_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.eos_token_id == ref.eos_token_id == PAD_ID
    assert tok.eos_token_ids == (PAD_ID, EOS_ID)
    assert tok.all_special_ids == ref.all_special_ids
    assert tok.encode(TEXTS[8]) == ref(TEXTS[8])["input_ids"]
