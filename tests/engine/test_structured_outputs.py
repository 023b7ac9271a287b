"""Constrained decoding in the engine, offline (`LLM`): on a tiny random-weight model sampling
at temperature 1 — which left alone writes anything — every JSON-schema output validates, every
regex output fullmatches, every choice is one of the choices, an EBNF grammar's outputs parse;
a constrained row's mask never leaks into its neighbours; preemption, n > 1 and both
scheduling modes keep outputs valid; a bad constraint is refused before the engine sees it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from aserve import LLM, SamplingParams
from aserve.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Tell me about yourself.", "JSON please:", "The weather today"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32")


def constrained(spec: StructuredOutputsParams, **extra) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 200, "seed": 7,
                             "structured_outputs": spec, **extra})


def texts(llm: LLM, prompts: list, params) -> list[str]:
    return [c.text for o in llm.generate(prompts, params) for c in o.outputs]


def test_unconstrained_sampling_is_not_json(llm):
    """The test model's own text is not JSON: the constraint below does the work."""
    outputs = texts(llm, PROMPTS, SamplingParams(temperature=1.0, max_tokens=40, seed=7))
    for text in outputs:
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


def test_json_schema_outputs_validate_also_with_n_2(llm):
    outputs = texts(llm, PROMPTS, constrained(StructuredOutputsParams(json=SCHEMA), n=2))
    assert len(outputs) == 6
    for text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_choice_and_grammar_outputs_hold(llm):
    # any object: its strings are unbounded, so the random model is nudged to close them
    closing = {llm.tokenizer.token_to_id(c): 4.0 for c in ('"', "}")}
    for text in texts(llm, PROMPTS, constrained(StructuredOutputsParams(json_object=True),
                                                max_tokens=400, logit_bias=closing)):
        assert isinstance(json.loads(text), dict)
    pattern = r"[a-f]{2,4}-\d{3}"
    for text in texts(llm, PROMPTS, constrained(StructuredOutputsParams(regex=pattern))):
        assert re.fullmatch(pattern, text), text
    choices = ["yes", "no way", 'naïve "quoted"']
    for text in texts(llm, PROMPTS * 2, constrained(StructuredOutputsParams(choice=choices))):
        assert text in choices
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for text in texts(llm, PROMPTS, constrained(StructuredOutputsParams(grammar=grammar))):
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


def test_a_constrained_row_does_not_change_its_neighbours(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    alone = texts(llm, PROMPTS[:1], greedy)
    params = [greedy, constrained(StructuredOutputsParams(json=SCHEMA)),
              constrained(StructuredOutputsParams(regex="[0-9]{5}"))]
    beside = llm.generate(PROMPTS, params)
    assert beside[0].outputs[0].text == alone[0]
    jsonschema.validate(json.loads(beside[1].outputs[0].text), SCHEMA)
    assert re.fullmatch("[0-9]{5}", beside[2].outputs[0].text)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_preempted_constrained_requests_resume_in_their_grammar(llama_dir, async_scheduling):
    """Under a cache too small for all of them, requests are preempted mid-JSON and recomputed;
    their grammars are replayed over the tokens they had, and greedy outputs equal an
    unpreempted run's."""
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=spec)
    prompts = [p * 3 for p in PROMPTS]
    roomy = LLM(llama_dir, dtype="float32", async_scheduling=async_scheduling)
    expected = texts(roomy, prompts, params)
    tight = LLM(llama_dir, dtype="float32", num_kv_blocks=15, block_size=8,
                max_num_batched_tokens=16, max_model_len=96,
                async_scheduling=async_scheduling)
    got = texts(tight, prompts, params)
    assert tight.stats().num_preemptions > 0
    assert got == expected
    for text in got:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_constrained_request_that_runs_out_of_tokens_ends_with_length(llm):
    out = llm.generate(PROMPTS[:1], constrained(StructuredOutputsParams(json=SCHEMA),
                                                max_tokens=3))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "nope"}), r"structured_outputs\.json is not a valid JSON schema"),
    (dict(json="{not json"), r"structured_outputs\.json is not valid JSON"),
    (dict(regex="a(b"), r"structured_outputs\.regex could not be compiled"),
    (dict(grammar="root ::= undefined_rule"), r"structured_outputs\.grammar could not be"),
    (dict(choice=[]), r"structured_outputs\.choice must be a non-empty list"),
    (dict(regex="a", choice=["b"]), r"exactly one of"),
])
def test_a_bad_constraint_is_refused_before_the_engine(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=spec))
    assert not llm.engine_core.has_unfinished_requests()


def test_a_structural_tag_compiles_and_a_bad_one_is_refused(llm):
    """Free text in which the trigger opens a schema-constrained segment (vLLM's shape)."""
    tag = {"type": "structural_tag", "triggers": ["<call="],
           "structures": [{"begin": "<call=weather>", "schema": SCHEMA, "end": "</call>"}]}
    out = llm.generate(PROMPTS[:1], constrained(StructuredOutputsParams(structural_tag=tag),
                                                max_tokens=8))[0].outputs[0]
    assert len(out.token_ids) <= 8
    from aserve.structured_output import GrammarMatcher, allocate_token_bitmask

    compiled = llm.processor.grammar_compiler().compile(StructuredOutputsParams(
        structural_tag=tag))
    matcher = GrammarMatcher(compiled, llm.tokenizer.encode("hi <call=weather>",
                                                            add_special_tokens=False))
    bitmask = allocate_token_bitmask(1, llm.model_info.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    allowed = [t for t in range(llm.model_info.vocab_size)
               if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed and all(llm.tokenizer.decode([t]).lstrip().startswith("{") or
                           not llm.tokenizer.decode([t]).strip() for t in allowed)
    with pytest.raises(ValueError, match="structured_outputs.structural_tag needs"):
        llm.generate(PROMPTS[:1], constrained(StructuredOutputsParams(
            structural_tag={"structures": []})))


def test_greedy_rows_checked_after_sampling_equal_rows_masked_first(llm, monkeypatch):
    """On the CPU a plain greedy constrained row is sampled unmasked and its token checked
    after (`GrammarMasks.check`); every other constrained row is masked first. Both
    give the same tokens and logprobs, and the random model's tokens are refused often enough
    that the refused path runs."""
    from aserve.runner import grammar_masks

    refused = []
    masked_argmax = grammar_masks.masked_argmax
    monkeypatch.setattr(grammar_masks, "masked_argmax",
                        lambda logits, rows, bitmask: refused.append(len(rows))
                        or masked_argmax(logits, rows, bitmask))
    greedy = dict(temperature=0.0, seed=None)
    params = [constrained(StructuredOutputsParams(json=SCHEMA), **greedy),
              constrained(StructuredOutputsParams(regex=r"[a-f]{2,4}-\d{3}"), **greedy),
              constrained(StructuredOutputsParams(choice=["yes", "no way"]), **greedy),
              constrained(StructuredOutputsParams(json=SCHEMA), **greedy, logprobs=2),
              constrained(StructuredOutputsParams(json=SCHEMA), **greedy, min_tokens=40),
              constrained(StructuredOutputsParams(json=SCHEMA))]  # temperature 1, seeded
    runner = llm.engine_core.executor.worker.runner.grammar_masks  # (its constrained rows)
    assert runner.check_greedy_tokens  # the CPU's default

    def run() -> list:
        return [(c.token_ids, c.logprobs) for o in llm.generate(PROMPTS * 2, params)
                for c in o.outputs]

    checked = run()
    assert sum(refused) > 10
    runner.check_greedy_tokens = False
    try:
        refused.clear()
        assert run() == checked and not refused
    finally:
        runner.check_greedy_tokens = True


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_stop_tokens_back_until_the_grammar_ends(llm, temperature):
    """min_tokens keeps EOS out while the grammar allows more (`[ab]+` with EOS favoured would
    stop at once), and yields to a grammar that has ended: a choice ends with "stop" however
    short, instead of the request having nothing left to sample."""
    eos = llm.tokenizer.eos_token_ids[0]
    spec = StructuredOutputsParams(regex="[ab]+")
    favoured = dict(temperature=temperature, max_tokens=12, logit_bias={eos: 30.0})
    early = llm.generate(PROMPTS, constrained(spec, **favoured))
    assert all(len(o.outputs[0].token_ids) <= 2 for o in early)
    for out in llm.generate(PROMPTS, constrained(spec, **favoured, min_tokens=6)):
        assert len(out.outputs[0].token_ids) >= 6
        assert re.fullmatch("[ab]+", out.outputs[0].text), out.outputs[0].text
    choices = ["yes", "no way"]
    for params in (constrained(StructuredOutputsParams(choice=choices), min_tokens=30,
                               temperature=temperature),
                   constrained(StructuredOutputsParams(choice=choices), min_tokens=30,
                               temperature=temperature, logit_bias={eos: -5.0})):
        for out in llm.generate(PROMPTS, params):
            assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"
