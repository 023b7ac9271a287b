"""Builders for tiny HF model directories used by the tests: a byte-level BPE tokenizer trained
here with `tokenizers`, and (in `make_hf_model`) random-weight transformers models saved with
`save_pretrained`. Nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks, like pages of memory.",
    "Continuous batching lets finished requests leave and new ones join every step.",
    "Hello! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1024 3.14159",
    "Emoji make people smile 😀😃🎉🚀👍🏽 and hearts ❤️ too.",
    "中文文本测试：你好，世界！今天天气很好。",
    "日本語のテキスト：こんにちは世界。ありがとうございます。",
    "한국어 문장: 안녕하세요 세계.",
    "Ünïcödé äccents: café, naïve, résumé, São Paulo, Zürich.",
    "Tabs\tand  double  spaces, and new\nlines\n\nand more.",
]


def corpus(repeats: int = 40) -> list[str]:
    return [f"{s} {i % 7}" for i in range(repeats) for s in _SENTENCES]


# Gemma's chat formats, written here after the public templates' behaviour: turns between
# <start_of_turn>role and <end_of_turn>, the assistant called "model"; Gemma-2 refuses a system
# message and non-alternating roles, Gemma-3 folds a system message into the first user turn and
# takes content as a string or a list of text parts.
GEMMA_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_EOS_IDS = [1, 4]  # <eos>, <end_of_turn>
GEMMA2_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512,
                    model_max_length: int = 2048, chat_template: str | None = None,
                    texts: Iterable[str] | None = None,
                    added_tokens: Sequence[str] = ()) -> Path:
    """Train a byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json.

    Special tokens: ChatML's (`SPECIAL_TOKENS`), or with a Gemma chat template Gemma's
    (`GEMMA_SPECIAL_TOKENS`: <pad> 0, <eos> 1, <bos> 2, turn markers 3, 4; the template writes
    the BOS). `added_tokens`: more whole tokens, not special (ids right after the special ones;
    as Qwen's "<tool_call>", which decoding keeps). `texts`: the training corpus (default:
    `corpus()`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    gemma = chat_template in (GEMMA2_CHAT_TEMPLATE, GEMMA3_CHAT_TEMPLATE)
    specials = GEMMA_SPECIAL_TOKENS if gemma else SPECIAL_TOKENS
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=[*specials, *added_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus() if texts is None else texts, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    if added_tokens:  # the trainer adds them all as special: these are not
        saved = json.loads((out / "tokenizer.json").read_text())
        for entry in saved["added_tokens"]:
            entry["special"] = entry["content"] not in added_tokens
        (out / "tokenizer.json").write_text(json.dumps(saved))
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": s in specials}
        for i, s in enumerate([*specials, *added_tokens])
    }
    tok_cfg = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template or CHAT_TEMPLATE,
    }
    if gemma:
        tok_cfg.update(bos_token="<bos>", eos_token="<eos>",
                       pad_token="<pad>")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


_ARCH_CONFIGS = {  # arch -> (transformers config class name, model class name)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    # the text config goes under `text_config`, next to TINY_VISION_CONFIG
    "gemma3-mm": ("Gemma3Config", "Gemma3ForConditionalGeneration"),
}

# Tiny and fast, yet peaked: the default init (std 0.02) gives near-flat logits whose argmax
# flips between implementations; std INIT_STD gives logits of std ~2.4 and a median top-1/top-2
# gap ~0.5 (about 0.1% of positions under 1e-3), and greedy runs stay varied. Biases (zero in
# HF's init) and norm weights (ones) are randomised too, so loading them is tested.
INIT_STD = 0.3
# The reference's attention: HF's eager one, always. Where transformers offers SDPA for a model
# it may drop what SDPA cannot express: transformers 5.17 ran Gemma-2 through SDPA without its
# attention soft-cap (seen on an H200: its greedy tokens were the uncapped model's), while 5.25
# refuses SDPA for Gemma-2 and falls back to eager. Eager is the implementation every model has.
HF_ATTENTION = "eager"
TINY_CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    initializer_range=INIT_STD, rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    pad_token_id=PAD_ID, tie_word_embeddings=False,
)


# Gemma scales its embedding by sqrt(hidden) and ties the LM head to it: at INIT_STD the token's
# own row dominates the residual stream and greedy repeats one token. A small embedding keeps
# the runs varied; a final norm scale of ~3 keeps the logits peaked (top-1/top-2 gaps over 1e-3
# on the test prompts, against float32 differences of ~1e-6).
GEMMA_EMBED_STD = 0.05
GEMMA_FINAL_NORM_OFFSET = 2.0  # Gemma's norm scale is 1 + weight
TINY_VISION_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, image_size=28, patch_size=14)


# Tiny models whose windows bite: prompts and generations of the tests run past the window,
# and each case's greedy output changes when its window is lifted (tests check it). name ->
# (arch, overrides of make_hf_model).
_GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
_GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"]
SLIDING_CASES = {
    # layers: sliding (W=10), full; both soft-caps; attention scale 24 ** -0.5 (not head_dim's)
    "gemma2": ("gemma2", dict(sliding_window=10, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # layers: sliding, sliding (W=8, rope base 1e4), full (rope base 1e6, linear factor 8)
    "gemma3": ("gemma3", dict(num_hidden_layers=3, layer_types=_GEMMA3_LAYERS, sliding_window=8,
                              query_pre_attn_scalar=24, rope_parameters=_GEMMA3_ROPE)),
    "gemma3-mm": ("gemma3-mm", dict(num_hidden_layers=3, layer_types=_GEMMA3_LAYERS,
                                    sliding_window=8, query_pre_attn_scalar=24,
                                    rope_parameters=_GEMMA3_ROPE)),
    # every layer slides, W=7: not a multiple of any block size
    "mistral": ("mistral", dict(sliding_window=7)),
    # layer 0 full, layers 1-2 slide (W=13)
    "qwen2": ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=13,
                            max_window_layers=1)),
}


# Tiny mixtures of experts whose routing matters: tests check that changing top-k (and, for
# Qwen, the renormalisation) changes HF's greedy output. name -> (arch, overrides).
MOE_CASES = {
    # 5 experts (odd: an uneven split over 2 expert-parallel ranks), top-2, renormalised
    "mixtral": ("mixtral", dict(num_local_experts=5, num_experts_per_tok=2)),
    # 6 experts top-3 unnormalised + a sigmoid-gated shared expert; layer 1 dense
    # (mlp_only_layers), layer 2 sparse
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=3,
                                    moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                    norm_topk_prob=False, mlp_only_layers=[1])),
    # 7 experts top-3 renormalised, q/k norms; every other layer sparse (decoder_sparse_step 2)
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=3, num_experts=7, num_experts_per_tok=3,
                                    moe_intermediate_size=48, norm_topk_prob=True,
                                    decoder_sparse_step=2)),
    # 6 experts top-3 of biased logits; layers: sliding (W=8), full, sliding; attention sinks;
    # biased experts with a clamp that bites (limit 1.5); YaRN rope (factor 4 over 128)
    "gpt_oss": ("gpt_oss", dict(num_hidden_layers=3, num_local_experts=6, num_experts_per_tok=3,
                                intermediate_size=48, sliding_window=8, swiglu_limit=1.5,
                                layer_types=["sliding_attention", "full_attention",
                                             "sliding_attention"],
                                rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0,
                                                 "truncate": False, "rope_theta": 150000.0,
                                                 "original_max_position_embeddings": 128})),
}


def _randomise_biases_and_norms(model, gemma: bool = False) -> None:
    """Gemma's norm weights are offsets from 1 (HF initialises them to zeros)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_bias", ".sinks")):  # gpt-oss: expert biases, sinks
                param.normal_(0.0, 1.0 if name.endswith(".sinks") else INIT_STD)
            elif "norm" in name:
                param.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(param))
        if gemma:
            model.model.embed_tokens.weight.normal_(0.0, GEMMA_EMBED_STD)
            model.model.norm.weight.add_(GEMMA_FINAL_NORM_OFFSET)


def _build(arch: str, kwargs: dict, seed: int):
    """The random-weight transformers model (float32, eval mode)."""
    import torch
    import transformers

    if arch == "gemma3-mm":
        return _build_gemma3_mm(kwargs, seed)
    if arch == "mistral":
        kwargs.setdefault("sliding_window", None)
    config_name, model_name = _ARCH_CONFIGS[arch]
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    _randomise_biases_and_norms(model, gemma=arch.startswith("gemma"))
    return model


def _build_gemma3_mm(text_kwargs: dict, seed: int):
    """A Gemma3ForConditionalGeneration (tiny vision tower) whose text model has the weights of
    the "gemma3" model built from the same arguments: both generate the same text."""
    import torch
    import transformers

    text = _build("gemma3", dict(text_kwargs), seed)
    tied = text_kwargs.pop("tie_word_embeddings")
    config = transformers.Gemma3Config(text_config=text_kwargs, vision_config=TINY_VISION_CONFIG,
                                       mm_tokens_per_image=4, tie_word_embeddings=tied)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict())
        model.lm_head.weight.copy_(text.lm_head.weight)
    return model


def make_hf_model(out_dir: str | Path, arch: str = "llama", *, seed: int = 0,
                  max_shard_size: str | None = None, fused_experts: bool = False,
                  **config_overrides) -> Path:
    """Save a tiny random-weight transformers model (fp32) plus tokenizer and generation config.

    arch: llama | mistral | qwen2 | qwen3 | gemma2 | gemma3 | gemma3-mm (a
    Gemma3ForConditionalGeneration with a tiny vision tower around the gemma3 text model of the
    same overrides and seed) | mixtral | qwen2_moe | qwen3_moe | gpt_oss. `fused_experts=True`
    saves MoE experts in transformers 5's fused 3-D layout instead of the per-expert one.
    `config_overrides` go to the transformers (text) config (e.g. num_key_value_heads=4,
    tie_word_embeddings=True, head_dim=32, rope_scaling={"rope_type": "llama3", ...});
    `max_shard_size="100KB"` writes a sharded checkpoint with model.safetensors.index.json.
    Gemma models are tied by default.
    """
    tied = {"tie_word_embeddings": True} if arch.startswith("gemma") else {}
    model = _build(arch, {**TINY_CONFIG, **tied, **config_overrides}, seed)
    out = Path(out_dir)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if fused_experts:
        save_kwargs["save_original_format"] = False
    model.save_pretrained(out, safe_serialization=True, **save_kwargs)
    build_tokenizer(out, vocab_size=model.config.get_text_config().vocab_size)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def load_hf_model(model_dir: str | Path, dtype=None):
    """HF transformers' `AutoModelForCausalLM` for `model_dir`, in eval mode (float32 default),
    with HF's eager attention (`HF_ATTENTION`)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32,
                                                attn_implementation=HF_ATTENTION).eval()


def hf_greedy(model, prompts: list[list[int]], num_new: int, *, eos_token_id: int | None = None,
              pad_token_id: int = PAD_ID, with_logits: bool = False):
    """HF transformers' greedy continuations (CPU), one prompt at a time.

    model: a model dir (loaded in float32) or a loaded HF model. Without `eos_token_id` each
    continuation is exactly `num_new` tokens; with it, it stops there (at most `num_new`).
    Returns the continuations' token ids, and with `with_logits` also their raw logits (one
    float32 [len, vocab] tensor per prompt): `(outputs, logits)`.
    """
    import torch

    if isinstance(model, (str, Path)):
        model = load_hf_model(model)
    lengths = ({"min_new_tokens": num_new} if eos_token_id is None
               else {"eos_token_id": eos_token_id})
    extra = {"output_logits": True, "return_dict_in_generate": True} if with_logits else {}
    outputs, logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=num_new, pad_token_id=pad_token_id,
                                 **lengths, **extra)
            sequences = out.sequences if with_logits else out
            outputs.append(sequences[0, len(prompt):].tolist())
            if with_logits:
                logits.append(torch.cat(out.logits).float())
    return (outputs, logits) if with_logits else outputs


# A ChatML template that renders tools as Qwen2.5's does (a system block listing them, calls in
# <tool_call> tags, results as tool messages): what the hermes format is detected from.
HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures in <tools></tools>:\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{%- elif message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{{ message['content'] or '' }}"
    "{%- for call in message.get('tool_calls', []) %}\n<tool_call>\n"
    "{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message['role'] != 'system' or not loop.first %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]  # ids 3, 4 of a tool model's tokenizer


def make_tool_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny Qwen2 whose tokenizer has Qwen's "<tool_call>" / "</tool_call>" as whole tokens
    (not special) and whose chat template renders tools as Qwen2.5's does; 2048 positions,
    room for a prompt that lists tools."""
    out = make_hf_model(out_dir, "qwen2", seed=seed, max_position_embeddings=2048)
    build_tokenizer(out, vocab_size=TINY_CONFIG["vocab_size"],
                    chat_template=HERMES_TOOLS_TEMPLATE, added_tokens=TOOL_TOKENS)
    return out
