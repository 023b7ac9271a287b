"""Train a small EAGLE-1 head for a model on this CPU and save it in the checkpoint format vLLM
loads (`fc.weight`/`fc.bias`, `layers.0.*`; the target's embedding and LM head are shared), so
that `benchmarks/speculative.py --eagle DIR` can measure the `eagle` method with a trained head
(no EAGLE head for SmolLM2 is published, and none could be downloaded here). Prints one JSON line.

    python benchmarks/studies/eagle_head.py [--model SmolLM2-135M-Instruct.Q4_1.gguf]
        [--out ~/.cache/aserve-bench/smollm2-eagle] [--prompts 240] [-o 192] [--epochs 8]

The data is the target's own greedy replies (served by aserve) to generic chat prompts made
from templates: explanations, lists, poems, code, and some rewrites and conversions of a given
text (none of them benchmarks/speculative.py's prompts). HF transformers gives the target's
final normed hidden states h_p of every prompt + reply. The head learns, at each position p,
h_{p+1} from [embed(x_{p+1}), h_p] (EAGLE-1: fc, then one Llama layer without its input norm,
initialised from the target's last layer): cross-entropy of the target's LM head on them
against the target's own greedy token at p + 2 (distilled: the prompts' positions too) plus
--reg-weight x smooth L1 on the features, with noise on the input features (later drafts read
the head's own outputs). The replies and
features are kept in --out/data.pt for a run with other training settings. Held-out sequences
give the teacher-forced top-1 agreement with the target's next token, over every position and
over the replies' alone (the chat template's system prompt, the same in every prompt, is easy).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from speculative import DEFAULT_MODEL, hf_dir_of  # noqa: E402

TOPICS = ["the moon", "volcanoes", "bread baking", "the Roman empire", "electric cars",
          "honey bees", "chess", "the water cycle", "jazz", "photosynthesis", "the internet",
          "mountain climbing", "coffee", "black holes", "recycling", "the piano", "deserts",
          "vaccines", "trains", "the ocean", "gardening", "rainbows", "robots", "libraries"]
TASKS = ["Explain {t} in a few sentences.", "List five facts about {t}.",
         "Write a short poem about {t}.", "Give three tips for someone interested in {t}.",
         "Write a short story that involves {t}.", "What are the pros and cons of {t}?",
         "Describe {t} to a child.", "Write a tweet about {t}."]
CODE_TASKS = ["reverses a string", "counts the vowels in a string", "returns the largest of a "
              "list", "checks whether a number is prime", "computes a factorial",
              "sorts a list of words by length", "merges two dictionaries",
              "removes duplicates from a list"]
SENTENCES = ["the weather was cold so we stayed at home and watched a film",
             "my brother bought a new bike last week and rides it every day",
             "the meeting has been moved to thursday afternoon at three",
             "please send me the report before the end of the day",
             "our team won the match after a long and difficult game"]


def make_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        kind = i % 5
        if kind <= 2:
            prompts.append(rng.choice(TASKS).format(t=rng.choice(TOPICS)))
        elif kind == 3:
            prompts.append(f"Write a Python function that {rng.choice(CODE_TASKS)}.")
        else:
            sentence = rng.choice(SENTENCES)
            prompts.append(rng.choice([
                f"Rewrite this sentence in formal English: {sentence}",
                f"Repeat this sentence with every word capitalised: {sentence}",
                f"Turn this into a JSON object with keys who, what, when: {sentence}"]))
    return prompts


def chat_ids(model: Path, prompts: list[str]) -> list[list[int]]:
    """Each prompt's token ids through the model's chat template."""
    from transformers import AutoTokenizer

    from aserve.quantization.gguf_file import gguf_model_dir

    tokenizer = AutoTokenizer.from_pretrained(gguf_model_dir(model))
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                    add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"] for p in prompts]


def generate(model: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """prompt + greedy reply token ids of each prompt, through the model's chat template."""
    from aserve import LLM, SamplingParams

    ids = chat_ids(model, prompts)
    with LLM(str(model), dtype="bfloat16") as llm:
        outs = llm.generate([{"prompt_token_ids": x} for x in ids],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [x + list(o.outputs[0].token_ids) for x, o in zip(ids, outs, strict=True)]


class Head(torch.nn.Module):
    """EAGLE-1: fc([embed(x_{p+1}), h_p]) -> one Llama layer (no input norm) -> y_p ~ h_{p+1}."""

    def __init__(self, target) -> None:
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        super().__init__()
        config = target.config
        h = config.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=True)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, h:] = torch.eye(h)
            self.fc.weight.add_(torch.randn_like(self.fc.weight) * 0.01)
            self.fc.bias.zero_()
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.layer.load_state_dict(target.model.layers[-1].state_dict())
        self.layer.input_layernorm = torch.nn.Identity()
        self.rope = LlamaRotaryEmbedding(config)
        self.embed = target.model.embed_tokens
        self.lm_head = target.lm_head

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        t = ids.shape[-1]
        x = self.fc(torch.cat([self.embed(ids), feats], -1))[None]
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        return self.layer(x, attention_mask=mask, position_ids=positions,
                          position_embeddings=self.rope(x, positions))[0]

    def state_for_vllm(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias}
        for name, tensor in self.layer.state_dict().items():
            out[f"layers.0.{name}"] = tensor
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--out", type=Path,
                   default=Path("~/.cache/aserve-bench/smollm2-eagle").expanduser())
    p.add_argument("--prompts", type=int, default=240)
    p.add_argument("-o", "--output-len", type=int, default=192)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--reg-weight", type=float, default=0.1,
                   help="weight of the features' loss beside the LM head's cross-entropy")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    start = time.perf_counter()
    hf_dir = hf_dir_of(args.model)
    target = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    for param in target.parameters():
        param.requires_grad_(False)
    data_key = [args.model.name, args.prompts, args.output_len, args.seed]
    data_path = args.out / "data.pt"  # the replies and features, kept for another run
    if data_path.exists() and torch.load(data_path, weights_only=True)["key"] == data_key:
        data = torch.load(data_path, weights_only=True)
        sequences, feats = data["sequences"], data["feats"]
        generated = featured = 0.0
    else:
        sequences = generate(args.model, make_prompts(args.prompts, args.seed),
                             args.output_len)
        generated = time.perf_counter() - start
        feats = []
        with torch.no_grad():  # (not inference mode: the features are training inputs)
            for seq in sequences:
                out = target(torch.tensor([seq]), output_hidden_states=True)
                feats.append(out.hidden_states[-1][0].clone())
        featured = time.perf_counter() - start - generated
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"key": data_key, "sequences": sequences, "feats": feats}, data_path)
    start = time.perf_counter()
    held = max(1, len(sequences) // 10)
    train, test = list(range(held, len(sequences))), list(range(held))
    head = Head(target)
    params = [q for q in head.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.epochs * len(train)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine to zero
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
        * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps)))
    scale = torch.cat(feats).std().item()
    with torch.no_grad():  # the target's greedy token after each position
        greedy = [target.lm_head(h).argmax(-1) for h in feats]
    losses = []
    for epoch in range(args.epochs):
        random.Random(epoch).shuffle(train)
        total = 0.0
        for i in train:
            seq, h = torch.tensor(sequences[i]), feats[i]
            ids, inputs, wanted = seq[1:], h[:-1], h[1:]
            noisy = inputs + torch.randn_like(inputs) * 0.05 * scale
            y = head(ids, noisy)
            loss = args.reg_weight * torch.nn.functional.smooth_l1_loss(y, wanted)
            rows = torch.randperm(len(seq) - 1)[:max(1, (len(seq) - 1) // 2)]  # (the LM head
            # over the vocabulary is most of a step's cost: half the rows)
            loss = loss + torch.nn.functional.cross_entropy(head.lm_head(y[rows]),
                                                            greedy[i][1:][rows])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
            schedule.step()
            total += loss.item()
        losses.append(round(total / len(train), 4))
    trained = time.perf_counter() - start
    prompt_lens = [len(x) for x in chat_ids(args.model, make_prompts(args.prompts, args.seed))]
    agree = count = reply_agree = reply_count = 0
    with torch.inference_mode():
        for i in test:
            seq, h = torch.tensor(sequences[i]), feats[i]
            predicted = head.lm_head(head(seq[1:], h[:-1])[:-1]).argmax(-1)
            actual = target.lm_head(h[1:-1]).argmax(-1)  # the target's own next tokens
            same = predicted == actual  # row p: the token at p + 2
            agree += int(same.sum())
            count += len(actual)
            reply = same[max(0, prompt_lens[i] - 2):]  # (the chat template's system prompt,
            reply_agree += int(reply.sum())  # the same in every prompt, is easy)
            reply_count += len(reply)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in target.config.to_dict().items()
              if k not in ("gguf", "architectures", "num_hidden_layers", "dtype", "torch_dtype")}
    config.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1, dtype="bfloat16")
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(head.state_for_vllm(), str(args.out / "model.safetensors"))
    print(json.dumps({"study": "eagle_head", "model": args.model.name, "out": str(args.out),
                      "sequences": len(sequences), "tokens": sum(map(len, sequences)),
                      "epochs": args.epochs, "loss_by_epoch": losses,
                      "heldout_top1_agreement": round(agree / max(1, count), 3),
                      "heldout_reply_top1_agreement": round(reply_agree / max(1, reply_count),
                                                            3),
                      "seconds": {"generate": round(generated, 1),
                                  "features": round(featured, 1),
                                  "train": round(trained, 1)}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
