"""`--runner`: auto picks pooling for a sentence-transformers directory or a bare decoder, its
defaults read from the Pooling module; generate is refused for a bare decoder; what aserve does
not run of a sentence-transformers pipeline is refused by name. (JSON files only: no weights.)"""

from __future__ import annotations

import json

import pytest

from aserve.config import PoolerConfig
from aserve.engine.arg_utils import EngineArgs
from aserve.engine.runner_choice import choose_pooler


def model_dir(tmp_path, architecture: str, modes: dict | None = None,
              modules: tuple[str, ...] = ("Transformer", "Pooling", "Normalize")):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    if modes is not None:
        (tmp_path / "modules.json").write_text(json.dumps([
            {"idx": i, "name": str(i), "path": "1_Pooling" if kind == "Pooling" else "",
             "type": f"sentence_transformers.models.{kind}"} for i, kind in enumerate(modules)]))
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    return str(tmp_path)


@pytest.mark.parametrize("mode, pooling_type", [("pooling_mode_lasttoken", "LAST"),
                                                ("pooling_mode_mean_tokens", "MEAN"),
                                                ("pooling_mode_cls_token", "CLS")])
def test_auto_reads_the_pooling_module(tmp_path, mode, pooling_type):
    path = model_dir(tmp_path, "Qwen3Model", {mode: True, "pooling_mode_max_tokens": False})
    assert choose_pooler(path, "auto") == PoolerConfig(pooling_type, normalize=True)


def test_without_a_normalize_module_vectors_are_not_normalised(tmp_path):
    path = model_dir(tmp_path, "LlamaForCausalLM", {"pooling_mode_mean_tokens": True},
                     modules=("Transformer", "Pooling"))
    assert choose_pooler(path, "auto") == PoolerConfig("MEAN", normalize=False)


def test_auto_chooses_by_the_architecture_without_sentence_transformers(tmp_path):
    (tmp_path / "bare").mkdir()
    (tmp_path / "lm").mkdir()
    bare = model_dir(tmp_path / "bare", "Qwen3Model")
    assert choose_pooler(bare, "auto") == PoolerConfig("LAST", normalize=True)  # vLLM's
    causal = model_dir(tmp_path / "lm", "Qwen3ForCausalLM")
    assert choose_pooler(causal, "auto") is None
    assert choose_pooler(causal, "pooling") == PoolerConfig()
    with pytest.raises(ValueError, match="bare decoder .* --runner pooling"):
        choose_pooler(bare, "generate")
    with pytest.raises(ValueError, match="runner must be one of"):
        choose_pooler(causal, "embed")


def test_what_aserve_does_not_run_is_refused_by_name(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    max_pooling = model_dir(tmp_path / "a", "Qwen3Model", {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        choose_pooler(max_pooling, "auto")
    dense = model_dir(tmp_path / "b", "Qwen3Model", {"pooling_mode_lasttoken": True},
                      modules=("Transformer", "Pooling", "Dense", "Normalize"))
    with pytest.raises(ValueError, match="Dense"):
        choose_pooler(dense, "auto")


def test_the_pooling_runner_refuses_what_it_cannot_pool_under(tmp_path):
    path = model_dir(tmp_path, "Qwen3Model")
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        EngineArgs(model=path, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineArgs(model=path, speculative_config={"method": "ngram"})
    assert EngineArgs(model=path, tensor_parallel_size=2).pooler == PoolerConfig()
