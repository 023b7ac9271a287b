#!/usr/bin/env python3
"""Train aserve's built-in demo model (`aserve/assets/aserve-demo/`).

A few-million-parameter Llama with its own byte-level BPE tokenizer, trained from scratch on the
English dialogues of chatterbot-corpus (BSD-3-Clause), formatted as ChatML user/assistant turns.
It answers greetings in words; it is a demo of the server, not a useful assistant.

    pip install -r scripts/requirements-train.txt
    python scripts/train_demo_model.py --out aserve/assets/aserve-demo

Data: every English file except `coding.yml` (code blocks a model this size cannot learn in
minutes), whitespace normalised, exact duplicates dropped. A conversation of k turns gives one
example per starting turn i (windows of up to two exchanges ending on an assistant turn), so each
turn after the first is a reply somewhere. Augmentations, all deterministic: every fourth example
gets a system message; short first user turns also appear lower-cased without end punctuation;
greetings are repeated. The loss covers assistant tokens only (reply + `<|im_end|>`); system, user
and template tokens are context.

Repeatable: the corpus order, the tokenizer, the init (`torch.manual_seed`) and the batch order
(a seeded `torch.Generator`) are fixed, and torch runs on `--threads` threads (default 2): the
same command gives the same loss curve. `--minutes` only stops early; the schedule is `--steps`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are aserve-demo, a tiny demo model.",
                  "You are a friendly chatbot."]
EXCLUDED_FILES = {"coding.yml"}
SAMPLE_PROMPTS = ["Hello", "Hi", "How are you?", "Good morning", "What is your name?"]
GREETING_REPEATS = 3
MAX_TURNS = 4  # turns per example window
MAX_TOKENS = 256  # per example; longer ones are dropped
WORD = re.compile(r"[A-Za-z']+")
MODEL_CONFIG = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=512,
    rope_theta=10000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True,
    attention_bias=False, mlp_bias=False, initializer_range=0.02,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)


# ---------------------------------------------------------------------------------------- data

def corpus_dir() -> Path:
    import chatterbot_corpus

    return Path(chatterbot_corpus.__file__).parent / "data" / "english"


def load_conversations(root: Path) -> dict[str, list[list[str]]]:
    """{file stem: conversations}, files sorted, whitespace normalised, duplicates dropped."""
    import yaml

    out: dict[str, list[list[str]]] = {}
    seen: set[tuple[str, ...]] = set()
    for path in sorted(root.glob("*.yml")):
        if path.name in EXCLUDED_FILES:
            continue
        convs = []
        for conv in yaml.safe_load(path.read_text(encoding="utf-8"))["conversations"]:
            turns = tuple(" ".join(str(t).split()) for t in conv)
            if len(turns) >= 2 and all(turns) and turns not in seen:
                seen.add(turns)
                convs.append(list(turns))
        out[path.stem] = convs
    return out


def windows(turns: list[str]) -> list[list[str]]:
    """Every window of up to MAX_TURNS turns with an even length, one per starting turn."""
    result = []
    for start in range(len(turns) - 1):
        n = min(MAX_TURNS, len(turns) - start) // 2 * 2
        result.append(turns[start:start + n])
    return result


def casual(text: str) -> str:
    return text.lower().rstrip(".!?")


def make_examples(conversations: dict[str, list[list[str]]]) -> list[list[dict[str, str]]]:
    """Chat messages per example (roles alternate user/assistant), in a fixed order."""
    examples = []
    for stem, convs in conversations.items():
        repeats = GREETING_REPEATS if stem == "greetings" else 1
        for conv in convs:
            for turns in windows(conv):
                variants = [turns]
                if len(turns[0].split()) <= 6 and casual(turns[0]) != turns[0]:
                    variants.append([casual(turns[0]), *turns[1:]])
                for variant in variants * repeats:
                    roles = ["user", "assistant"] * (len(variant) // 2)
                    messages = [{"role": r, "content": c} for r, c in zip(roles, variant)]
                    if len(examples) % 4 == 0:
                        system = SYSTEM_PROMPTS[len(examples) // 4 % len(SYSTEM_PROMPTS)]
                        messages.insert(0, {"role": "system", "content": system})
                    examples.append(messages)
    return examples


def render(messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """ChatML text (as CHAT_TEMPLATE renders it) and the character spans the loss covers."""
    text, spans = "", []
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"] + "<|im_end|>"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
        text += "\n"
    return text, spans


def corpus_words(conversations: dict[str, list[list[str]]]) -> list[str]:
    """The training data's vocabulary: lower-cased runs of letters and apostrophes, sorted."""
    words = {w.strip("'").lower() for convs in conversations.values() for conv in convs
             for turn in conv for w in WORD.findall(turn)}
    return sorted(w for w in words if w)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def encode(tok, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of the whole rendered text, and labels (-100 outside assistant spans)."""
    text, spans = render(messages)
    enc = tok.encode(text)
    labels = [i if any(a <= s < b for a, b in spans) else -100
              for i, (s, _) in zip(enc.ids, enc.offsets)]
    return enc.ids, labels


# ------------------------------------------------------------------------------------ training

def epoch_batches(lengths: list[int], batch_size: int, generator) -> list[list[int]]:
    """Shuffled batches of similar length: shuffle, sort within chunks of 16 batches, shuffle."""
    import torch

    order = torch.randperm(len(lengths), generator=generator).tolist()
    chunk = 16 * batch_size
    batches = []
    for i in range(0, len(order), chunk):
        part = sorted(order[i:i + chunk], key=lambda j: lengths[j])
        batches += [part[k:k + batch_size] for k in range(0, len(part), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def collate(data: list[tuple[list[int], list[int]]], batch: list[int]):
    import torch

    width = max(len(data[j][0]) for j in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, j in enumerate(batch):
        n = len(data[j][0])
        ids[row, :n] = torch.tensor(data[j][0])
        labels[row, :n] = torch.tensor(data[j][1])
        mask[row, :n] = 1
    return ids, labels, mask


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, lr: float, weight_decay: float):
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train(model, data, args) -> dict:
    import torch
    from tqdm import tqdm

    generator = torch.Generator().manual_seed(args.seed)
    lengths = [len(ids) for ids, _ in data]
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    batches: list[list[int]] = []
    losses: list[float] = []
    start = time.time()
    model.train()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True, mininterval=1.0)
    for step in bar:
        if not batches:
            batches = epoch_batches(lengths, args.batch_size, generator)
        ids, labels, mask = collate(data, batches.pop())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}", refresh=False)
        if args.log_every and (step + 1) % args.log_every == 0:
            bar.write(json.dumps({"step": step + 1, "loss": round(losses[-1], 4)}))
        if args.minutes and time.time() - start > args.minutes * 60:
            bar.write(f"stopping at step {step + 1}: --minutes {args.minutes} spent")
            break
    bar.close()
    model.eval()
    tail = losses[-50:]
    return {"final_loss": round(sum(tail) / len(tail), 4), "steps": len(losses),
            "seconds": round(time.time() - start, 1), "first_losses": [round(x, 4) for x in
                                                                          losses[:5]]}


# -------------------------------------------------------------------------------------- saving

def save_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, s in enumerate(SPECIAL_TOKENS)}
    config = {
        "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_model(model, out: Path, dtype_name: str) -> None:
    import torch
    from transformers import GenerationConfig

    model.to(getattr(torch, dtype_name))
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                               pad_token_id=PAD_ID)
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 writes rope settings under "rope_parameters" and the dtype as "dtype" only;
    # the flat legacy keys let transformers 4.x and simple config readers load the directory.
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.setdefault("rope_theta", MODEL_CONFIG["rope_theta"])
    config.setdefault("torch_dtype", dtype_name)
    config.setdefault("rope_scaling", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for stale in ("chat_template.jinja", "special_tokens_map.json"):
        (out / stale).unlink(missing_ok=True)


MODEL_CARD = """\
# aserve-demo

A {params_m:.1f}M-parameter Llama-architecture chat model trained from scratch by aserve's
`scripts/train_demo_model.py`. It ships inside the aserve package so that `python -m aserve` and
`LLM()` have something to serve on a machine with no model and no network.

**It is a demo, not a useful assistant.** It has mostly memorised short replies from a small
dialogue corpus: it answers greetings in words, sometimes sensibly, sometimes with nonsense, and
knows nothing else. Use it to try aserve, not to answer questions.

- Architecture: `LlamaForCausalLM`, hidden {hidden_size}, {num_hidden_layers} layers, \
{num_attention_heads} query / {num_key_value_heads} KV heads of dim {head_dim}, MLP \
{intermediate_size}, tied embeddings, vocab {vocab_size}, context {max_position_embeddings}; \
weights {dtype}.
- Tokenizer: byte-level BPE trained on the same text; special tokens `<|endoftext|>` (pad),
  `<|im_start|>` (bos), `<|im_end|>` (eos, ends every reply); ChatML chat template, system
  message optional.
- Data: the English dialogues of \
[chatterbot-corpus](https://github.com/gunthercox/chatterbot-corpus) 1.3.3 (every file but \
`coding.yml`), {examples:,} examples, {tokens:,} tokens; the loss covers assistant replies only.
- Training: {steps:,} AdamW steps of {batch_size} examples, peak lr {lr}, seed {seed}, float32 \
on {threads} CPU threads, {seconds:.0f} s; final loss {final_loss} (mean of the last 50 steps).

Greedy replies (float32):

{replies}

## Licence

The training data, chatterbot-corpus by Gunther Cox and contributors, is distributed under the
BSD 3-Clause licence (see the LICENSE file of its repository). The weights and tokenizer here are
derived from it and are distributed with aserve under aserve's licence (Apache-2.0), keeping
that attribution.
"""


def write_model_card(out: Path, args: argparse.Namespace, result: dict,
                     replies: dict[str, str]) -> None:
    lines = "\n".join(f"- {prompt!r} → {reply!r}" for prompt, reply in replies.items())
    text = MODEL_CARD.format(**MODEL_CONFIG, **result, params_m=result["params"] / 1e6,
                             dtype=args.dtype, batch_size=args.batch_size, lr=args.lr,
                             seed=args.seed, threads=args.threads, replies=lines)
    (out / "MODEL_CARD.md").write_text(text)


def check_round_trip(out: Path, examples: list[list[dict[str, str]]], tok) -> None:
    """transformers renders the saved chat template as `render` did and tokenizes it alike."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(out)
    for messages in examples[:8]:
        text = hf_tok.apply_chat_template(messages, tokenize=False)
        assert text == render(messages)[0], (text, render(messages)[0])
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text).ids


def sample_replies(model, tok, prompts: list[str]) -> dict[str, str]:
    import torch

    replies = {}
    for prompt in prompts:
        text, _ = render([{"role": "user", "content": prompt}])
        ids = torch.tensor([tok.encode(text + "<|im_start|>assistant\n").ids])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=32, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        replies[prompt] = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    return replies


# ---------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("aserve/assets/aserve-demo"))
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (sets the schedule)")
    p.add_argument("--minutes", type=float, default=0.0, help="stop early after this budget")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--log-every", type=int, default=250, help="0: progress bar only")
    p.add_argument("--words-out", type=Path, default=None,
                   help="also write the corpus vocabulary here (tests/data/demo_corpus_words.txt)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    conversations = load_conversations(corpus_dir())
    if args.words_out:
        args.words_out.parent.mkdir(parents=True, exist_ok=True)
        args.words_out.write_text("\n".join(corpus_words(conversations)) + "\n")
    examples = make_examples(conversations)
    texts = [render(m)[0] for m in examples]
    tok = train_tokenizer(texts, MODEL_CONFIG["vocab_size"])
    data = [e for e in (encode(tok, m) for m in examples) if len(e[0]) <= MAX_TOKENS]
    num_tokens = sum(len(ids) for ids, _ in data)
    print(f"{len(data)} examples, {num_tokens} tokens, tokenizer vocab {tok.get_vocab_size()}",
          file=sys.stderr)

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG)).float()
    params = sum(p.numel() for p in model.parameters())
    result = train(model, data, args)

    args.out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, args.out)
    save_model(model, args.out, args.dtype)
    check_round_trip(args.out, examples, tok)
    replies = sample_replies(model.float(), tok, SAMPLE_PROMPTS)
    for prompt, reply in replies.items():
        print(f"{prompt!r} -> {reply!r}", file=sys.stderr)
    result = {**result, "params": params, "examples": len(data), "tokens": num_tokens}
    write_model_card(args.out, args, result, replies)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
