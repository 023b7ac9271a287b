"""Sequence parallelism (Ulysses) on CPU (gloo): greedy output with sp=2 equals transformers'
token for token on a dense Llama (GQA: one kv head per SP rank), a hybrid sliding-window Gemma-3
(q/k norms, two ropes) and a Qwen2-MoE (shared expert, a dense layer), under the default
settings with prefix-cache hits and under 32-token chunks with preemption; a Mixtral under
sp=2 with expert parallelism's all-to-all over the SP ranks (and over sp=2 × tp=2); sp=2 × tp=2
on 4 ranks (kv heads replicated over the SP ranks) and pp=2 × sp=2; prompt logprobs as one
rank's; `python -m aserve --sequence-parallel-size 2`
serves the openai client; heads that SP cannot split, and expert parallelism without the
all-to-all combine, are refused at startup naming the constraint."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.parity import generate_ids, hf_reference
from helpers.server import free_port, wait_healthy

from aserve import LLM, SamplingParams
from aserve.layers.ulysses import UlyssesAttention

MODELS = ["llama", "gemma3", "qwen2_moe"]


@pytest.fixture(scope="module")
def reference(model_dir_factory, sliding_dir_factory, moe_dir_factory):
    """name -> HF's greedy run of that tiny model (prompts of 20, 37 and 60 tokens)."""
    dirs = {"llama": lambda: model_dir_factory("llama"),
            "gemma3": lambda: sliding_dir_factory("gemma3"),
            "qwen2_moe": lambda: moe_dir_factory("qwen2_moe"),
            "mixtral": lambda: moe_dir_factory("mixtral")}
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = hf_reference(name, dirs[name]())
        return cache[name]

    return get


def ulysses_layers(llm: LLM) -> list[UlyssesAttention]:
    layers = llm.engine_core.executor.worker.runner.model.attention_layers()
    assert all(isinstance(layer, UlyssesAttention) for layer in layers)
    return layers


@pytest.mark.parametrize("name", MODELS)
def test_sp2_greedy_matches_hf_with_prefix_cache_hits(reference, name):
    ref = reference(name)
    with LLM(ref.model_dir, dtype="float32", sequence_parallel_size=2) as llm:
        assert ulysses_layers(llm)[0].num_kv_heads == 1  # 2 kv heads over 2 SP ranks
        assert generate_ids(llm, ref.prompts) == ref.outputs
        hits = llm.stats().prefix_cache_hits
        assert generate_ids(llm, ref.prompts) == ref.outputs
        assert llm.stats().prefix_cache_hits > hits


@pytest.mark.parametrize("name", MODELS)
def test_sp2_greedy_matches_hf_with_32_token_chunks_and_preemption(reference, name):
    from aserve.core.kv_cache_utils import blocks_per_request, make_kv_cache_groups
    from aserve.models.loader import read_arch_config

    ref = reference(name)
    groups = make_kv_cache_groups(read_arch_config(ref.model_dir).layer_windows, 16)
    num_blocks = blocks_per_request(groups, 128, 32) + 2 + 1  # + the null block
    with LLM(ref.model_dir, dtype="float32", sequence_parallel_size=2, max_model_len=128,
             num_kv_blocks=num_blocks, max_num_batched_tokens=32) as llm:
        assert generate_ids(llm, ref.prompts) == ref.outputs
        assert llm.stats().num_preemptions > 0


def test_sp2_moe_with_the_expert_all_to_all_over_the_sp_ranks_matches_hf(reference):
    """5 experts over the 2 SP ranks (3 and 2); each rank dispatches its own tokens."""
    ref = reference("mixtral")
    with LLM(ref.model_dir, dtype="float32", sequence_parallel_size=2,
             enable_expert_parallel=True, moe_combine="all-to-all",
             max_num_batched_tokens=32) as llm:
        experts = llm.engine_core.executor.worker.runner.model.model.layers[0].mlp.experts
        assert experts.all_to_all and experts.local_experts == range(0, 3)
        assert generate_ids(llm, ref.prompts) == ref.outputs


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}], ids=["sp2-tp2", "pp2-sp2"])
def test_sp2_on_four_ranks_matches_hf(reference, layout):
    """sp2 × tp2: a TP rank's one kv head goes to both of its SP ranks; pp2 × sp2: each stage's
    SP ranks send their rows to their peer of the next stage."""
    ref = reference("llama")
    with LLM(ref.model_dir, dtype="float32", sequence_parallel_size=2, block_size=4,
             max_num_batched_tokens=32, **layout) as llm:
        layers = ulysses_layers(llm)
        assert layers[0].num_heads == (1 if "tensor_parallel_size" in layout else 2)
        assert generate_ids(llm, ref.prompts) == ref.outputs
        assert generate_ids(llm, ref.prompts) == ref.outputs
        assert llm.stats().prefix_cache_hits > 0


def test_sp2_prompt_logprobs_equal_one_ranks(llama_dir):
    """Rows with logits on both SP ranks, out of rank order (each request's last row, then the
    prompt-logprob spans), in 32-token chunks."""
    prompts = [list(range(40, 77)), list(range(300, 320)), list(range(100, 150))]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)

    def run(**layout):  # no measured prefill cap: both runs chunk alike, 32 tokens a step
        with LLM(llama_dir, dtype="float32", max_num_batched_tokens=32, max_prefill_step_ratio=0,
                 **layout) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return ([o.outputs[0].token_ids for o in outputs],
                [[None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()}
                  for d in o.prompt_logprobs] for o in outputs])

    want_ids, want_logprobs = run()
    got_ids, got_logprobs = run(sequence_parallel_size=2)
    assert got_ids == want_ids
    assert got_logprobs == want_logprobs


@pytest.mark.slow
def test_sp2_tp2_moe_with_the_expert_all_to_all_over_the_stage_matches_hf(reference):
    """5 experts over 4 ranks (2, 1, 1, 1); each TP rank dispatches half its group's rows."""
    ref = reference("mixtral")
    with LLM(ref.model_dir, dtype="float32", sequence_parallel_size=2, tensor_parallel_size=2,
             enable_expert_parallel=True, moe_combine="all-to-all",
             max_num_batched_tokens=32) as llm:
        experts = llm.engine_core.executor.worker.runner.model.model.layers[0].mlp.experts
        assert experts.local_experts == range(0, 2)
        assert generate_ids(llm, ref.prompts) == ref.outputs


def test_server_with_sp2_answers_openai_client(llama_dir, tmp_path):
    from openai import OpenAI

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "stderr.log", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aserve", "--model", str(llama_dir), "--port", str(port),
             "--dtype", "float32", "--max-model-len", "256", "--sequence-parallel-size", "2",
             "--served-model-name", "tiny-sp"], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_healthy(proc, url, timeout=180)  # (two ranks start; slower on a busy machine)
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        out = client.completions.create(model="tiny-sp", prompt="Hello there, how are you",
                                        max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
        with LLM(llama_dir, dtype="float32") as one:  # the text a single rank writes
            single = one.generate(["Hello there, how are you"],
                                  SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert out.choices[0].text == single[0].outputs[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_heads_sp_cannot_split_are_a_startup_error_naming_the_constraint(model_dir_factory):
    model_dir = model_dir_factory("llama", hidden_size=48, num_attention_heads=3,
                                  num_key_value_heads=1)
    result = subprocess.run(
        [sys.executable, "-m", "aserve", "--model", str(model_dir), "--dtype", "float32",
         "--sequence-parallel-size", "2", "--prompt", "Hello"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert ("--sequence-parallel-size 2 must divide the attention heads of each "
            "tensor-parallel rank (3)") in result.stderr


def test_sp_with_expert_parallel_needs_the_all_to_all_combine():
    from aserve.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="needs --moe-combine all-to-all"):
        EngineArgs(model="m", sequence_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel_size must be at least 1"):
        EngineArgs(model="m", sequence_parallel_size=0)
    layout = EngineArgs(model="m", sequence_parallel_size=2, tensor_parallel_size=2,
                        pipeline_parallel_size=2).rank_layout()
    assert (layout.world_size, layout.num_stages, layout.sp_size) == (8, 2, 2)
