"""EAGLE and EAGLE-3 heads (speculative decoding's `eagle` / `eagle3`): the drafts the served
head proposes, step by step under chunks, prefix hits, preemption and rejections, equal those
of a reference that recomputes the head from scratch over HF's target hidden states (HF's own
Llama modules for the head's layers); greedy outputs equal HF's; a head that predicts its
target well is accepted; checkpoints in vLLM's formats load (safetensors or
pytorch_model.bin, `midlayer.`, `model.` prefixes, own embedding); bad heads are refused."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers.eagle_heads import EagleReference, make_eagle_head, record_drafts
from helpers.hf_models import hf_greedy, make_hf_model

from aserve import LLM, SamplingParams
from aserve.config import SpeculativeConfigError

K = 3
AUX = [0, 2, 3]  # (layer 0's input: the embedding, to cover the stream before any layer)


@pytest.fixture(autouse=True)
def every_draft_proposed(monkeypatch):
    """The cost policy drafts by measured step times: lifted, so that the head keeps its K/V
    at every step and drafts as asked (tests/core/test_speculation.py tests the policy)."""
    monkeypatch.setattr("aserve.core.spec_policy.worthwhile_drafts", lambda k, *_: k)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("eagle_target"), "llama",
                         num_hidden_layers=4)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("eagle_heads")
    return {"eagle": make_eagle_head(root / "e1", target, 1, seed=1, layers=2),
            "eagle3": make_eagle_head(root / "e3", target, 3, seed=2, layers=2,
                                      aux_ids=AUX, draft_vocab=384)}


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 11, 19, 30)]


@pytest.mark.parametrize("settings", [
    {},
    {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 16, "block_size": 8},
    {"num_kv_blocks": 14, "block_size": 8, "max_model_len": 80},
], ids=["default", "16_token_chunks", "forced_preemption"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_the_reference_and_greedy_equals_hf(monkeypatch, target, heads, method,
                                                         settings) -> None:
    seen = record_drafts(monkeypatch)
    num_new = 24
    expected = hf_greedy(target, prompts(), num_new)
    spec = {"method": method, "model": str(heads[method]), "num_speculative_tokens": K}
    with LLM(target, dtype="float32", speculative_config=spec,
             enable_prefix_caching=False, **{"max_model_len": 256, **settings}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                            SamplingParams(temperature=0.0, max_tokens=num_new, min_tokens=num_new))
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert stats.spec_decode_num_draft_tokens > 0
    if "num_kv_blocks" in settings:
        assert stats.num_preemptions > 0
    reference = EagleReference(target, heads[method], 3 if method == "eagle3" else 1, AUX)
    assert len(seen) >= 20
    for tokens, drafts in seen:
        assert drafts == reference.drafts(tokens, K)[:len(drafts)], tokens


def test_beside_a_hybrid_gemma2_target(monkeypatch, tmp_path, model_dir_factory) -> None:
    """Gemma-2 (sliding and full layers, a scaled embedding, soft-caps): the head binds the
    full-attention group and reads the target's residual streams; drafts as the reference,
    greedy as HF. (It reads the embedding table unscaled, as vLLM's heads do; EAGLE-3's input
    norm makes the scale moot here.)"""
    from helpers.hf_models import SLIDING_CASES

    arch, overrides = SLIDING_CASES["gemma2"]
    gemma = model_dir_factory(arch, **{**overrides, "num_hidden_layers": 4})
    head = make_eagle_head(tmp_path / "head", gemma, 3, seed=5, aux_ids=AUX)
    seen = record_drafts(monkeypatch)
    expected = hf_greedy(gemma, prompts(), 16)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    with LLM(gemma, dtype="float32", max_model_len=256, block_size=8,
             speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                            SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16))
    assert [o.outputs[0].token_ids for o in outs] == expected
    reference = EagleReference(gemma, head, 3, AUX)
    assert len(seen) >= 10
    for tokens, drafts in seen:
        assert drafts == reference.drafts(tokens, K)[:len(drafts)]


def test_greedy_with_prefix_hits_equals_hf(target, heads) -> None:
    """The head's K/V of a cached prefix is the request's that computed it: greedy as HF."""
    shared = prompts()[3]
    batch = [shared + p for p in prompts()[:3]]
    expected = hf_greedy(target, batch, 16)
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": K}
    with LLM(target, dtype="float32", max_model_len=256, block_size=8,
             speculative_config=spec) as llm:
        for _ in range(2):
            outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                                SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16))
            assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.stats().prefix_cache_hits > 0


def test_a_head_that_predicts_its_target_is_accepted(tmp_path, target) -> None:
    """A target whose layers add nothing (o_proj and down_proj zero: the next token is a
    function of the current one, through the final norm and LM head) and an EAGLE-1 head that
    passes the next token's embedding through: every draft is the target's token, accepted;
    greedy as without drafts; random sampling accepts drafts too."""
    from safetensors.torch import load_file, save_file

    chain = tmp_path / "chain"
    make_hf_model(chain, "llama", num_hidden_layers=2)
    weights = load_file(str(chain / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
    weights["model.norm.weight"].fill_(1.0)  # argmax(lm_head(norm(e))) = argmax(lm_head(e))
    save_file(weights, str(chain / "model.safetensors"))
    head = make_eagle_head(tmp_path / "head", chain, 1, fc_bias=False)
    tensors = load_file(str(head / "model.safetensors"))
    h = tensors["fc.weight"].shape[0]
    tensors["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name].zero_()
    save_file(tensors, str(head / "model.safetensors"))
    batch = [{"prompt_token_ids": p} for p in prompts()]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)
    expected = hf_greedy(chain, prompts(), 20)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 4}
    with LLM(chain, dtype="float32", max_model_len=128, speculative_config=spec) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(batch, greedy)] == expected
        stats = llm.stats()
        assert stats.spec_decode_num_draft_tokens > 20
        assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens
        # random sampling verifies the one-hot drafts by rejection: accepted as often as
        # the target samples them
        sampled = llm.generate(batch, SamplingParams(temperature=0.8, max_tokens=20,
                                                     min_tokens=20))
        assert all(len(o.outputs[0].token_ids) == 20 for o in sampled)
        after = llm.stats()
    assert after.spec_decode_num_accepted_tokens > stats.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("variant", [
    dict(fmt="bin", prefix="model."),
    dict(midlayer=False, own_embedding=True),
], ids=["bin_with_model_prefix", "layers_names_own_embedding"])
def test_checkpoint_variants_load_and_draft_as_the_reference(monkeypatch, tmp_path, target,
                                                             variant) -> None:
    seen = record_drafts(monkeypatch)
    head = make_eagle_head(tmp_path / "head", target, 3, seed=4, aux_ids=AUX, **variant)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    with LLM(target, dtype="float32", max_model_len=128, speculative_config=spec) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts()[:2]],
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    reference = EagleReference(target, head, 3, AUX)
    assert seen
    for tokens, drafts in seen:
        assert drafts == reference.drafts(tokens, K)[:len(drafts)]


def test_bad_heads_are_refused(tmp_path, target, heads) -> None:
    with pytest.raises(SpeculativeConfigError, match="take a model"):
        LLM(target, dtype="float32", max_model_len=128, speculative_config={"method": "eagle"})
    with pytest.raises(SpeculativeConfigError, match="EAGLE head's directory"):
        LLM(target, dtype="float32", max_model_len=128,
            speculative_config={"method": "eagle3", "model": str(tmp_path / "none")})
    # the default auxiliary layers (2, L // 2, L - 3) do not fit a 4-layer target
    default = make_eagle_head(tmp_path / "default", target, 3)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        LLM(target, dtype="float32", max_model_len=128,
            speculative_config={"method": "eagle3", "model": str(default)})
    # a head of another hidden size
    wide = tmp_path / "wide"
    wide.mkdir()
    config = json.loads((heads["eagle"] / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    (wide / "model.safetensors").write_bytes((heads["eagle"] / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="hidden size"):
        LLM(target, dtype="float32", max_model_len=128,
            speculative_config={"method": "eagle", "model": str(wide)})
    # a head lacking a weight
    from safetensors.torch import load_file, save_file
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    (lacking / "config.json").write_text((heads["eagle3"] / "config.json").read_text())
    tensors = load_file(str(heads["eagle3"] / "model.safetensors"))
    del tensors["norm.weight"]
    save_file(tensors, str(lacking / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 weight"):
        LLM(target, dtype="float32", max_model_len=128,
            speculative_config={"method": "eagle3", "model": str(lacking)})


def test_the_auxiliary_layers_are_vllms_by_default_or_the_configs() -> None:
    from aserve.models.eagle import aux_layer_ids

    assert aux_layer_ids({}, 32) == (2, 16, 29)  # Llama-3.1-8B's
    config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 1, 3]}}
    assert aux_layer_ids(config, 8) == (1, 3, 5)
    for bad in ([1, 1, 3], [1, 3, 8], [-1, 2, 3]):
        with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
            aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": bad}}, 8)
