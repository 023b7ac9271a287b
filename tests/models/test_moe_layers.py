"""The MoE pieces against transformers' own: every HF router gives `select_experts`' weights and
ids exactly; `SparseMoeBlock` (loaded through aserve's loader from the HF block's fused tensors)
gives the HF block's output bit for bit in float32 — Mixtral, Qwen2-MoE with its shared
expert, gpt-oss' interleaved, biased, clamped experts; checkpoints load from per-expert and
fused tensors alike, an expert-parallel rank reads only its experts, and what aserve cannot run
is refused naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from aserve.config import MoEConfig
from aserve.distributed.state import set_ep
from aserve.kernels.moe import select_experts
from aserve.layers.moe import FusedMoE, SparseMoeBlock
from aserve.models import loader
from aserve.models.arch_config import ModelArchConfig
from aserve.models.causal_lm import CausalLM
from aserve.models.loader import load_weights

HIDDEN = 32


def hf_blocks(name: str, **config):
    """(HF MoE block, its config), eager experts, random weights of std 0.3, float32."""
    import transformers
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen2_moe import modeling_qwen2_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    kinds = {
        "mixtral": (transformers.MixtralConfig, modeling_mixtral.MixtralSparseMoeBlock,
                    dict(intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)),
        "qwen2_moe": (transformers.Qwen2MoeConfig, modeling_qwen2_moe.Qwen2MoeSparseMoeBlock,
                      dict(moe_intermediate_size=24, shared_expert_intermediate_size=40,
                           num_experts=6, num_experts_per_tok=3)),
        "qwen3_moe": (transformers.Qwen3MoeConfig, modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
                      dict(moe_intermediate_size=24, num_experts=7, num_experts_per_tok=4)),
        "gpt_oss": (transformers.GptOssConfig, modeling_gpt_oss.GptOssMLP,
                    dict(intermediate_size=24, num_local_experts=6, num_experts_per_tok=3,
                         swiglu_limit=2.0)),
    }
    config_cls, block_cls, defaults = kinds[name]
    cfg = config_cls(hidden_size=HIDDEN, num_hidden_layers=1, **{**defaults, **config})
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = block_cls(cfg).float().eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    return block, cfg


def moe_of(name: str, cfg) -> MoEConfig:
    arch = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}[name]
    return ModelArchConfig.from_hf({**cfg.to_dict(), "architectures": [arch]}).moe


def hf_route(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    router = getattr(block, "router", None) or block.gate
    _, weights, ids = router(x)
    return weights, ids


ROUTERS = {"mixtral": {}, "qwen2_moe": {"norm_topk_prob": False},
           "qwen2_moe-norm": {"norm_topk_prob": True}, "qwen3_moe": {"norm_topk_prob": True},
           "gpt_oss": {}}


@pytest.mark.parametrize("case", list(ROUTERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_experts_matches_every_hf_router(case, dtype):
    name = case.removesuffix("-norm")
    block, cfg = hf_blocks(name, **ROUTERS[case])
    block = block.to(dtype)
    moe = moe_of(name, cfg)
    x = torch.randn(41, HIDDEN, dtype=dtype)
    router = getattr(block, "router", None) or block.gate
    logits = nn.functional.linear(x, router.weight, getattr(router, "bias", None))
    weights, ids = select_experts(logits, moe.top_k, scoring=moe.scoring,
                                  renormalize=moe.renormalize,
                                  weights_dtype=dtype if moe.round_weights else None)
    hf_weights, hf_ids = hf_route(block, x)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights.float())


class Holder(nn.Module):
    """A model around one block: HF's names for it under `mlp.`, the loader's tables."""

    packed_modules = CausalLM.packed_modules
    checkpoint_prefixes = CausalLM.checkpoint_prefixes
    bare_prefixes: dict[str, str] = {}
    checkpoint_renames = ((r"^mlp\.router\.", "mlp.gate."),)  # gpt-oss names its router so

    @staticmethod
    def owns_weight(name: str) -> bool:
        return True

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.mlp = block


def load_block(hf_block: nn.Module, block: nn.Module, tmp_path: Path) -> Holder:
    """`block` with the HF block's weights, through a safetensors file and the loader."""
    holder = Holder(block)
    path = tmp_path / "block.safetensors"
    save_file({f"mlp.{k}": v.contiguous() for k, v in hf_block.state_dict().items()}, str(path))
    load_weights(holder, [path], tied=False)
    return holder


def aserve_block(name: str, cfg) -> SparseMoeBlock:
    from aserve.models.llama import LlamaMLP

    moe = moe_of(name, cfg)
    shared = None
    if moe.shared_expert_intermediate_size:
        arch = ModelArchConfig.from_hf({**cfg.to_dict(), "architectures": ["Qwen2MoeForCausalLM"]})
        shared = LlamaMLP(arch, moe.shared_expert_intermediate_size, reduce_results=False)
    return SparseMoeBlock(moe, HIDDEN, shared)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_sparse_moe_block_is_bit_equal_to_hf_block_in_float32(name, tmp_path):
    """The routed experts bit for bit; Qwen2-MoE's shared expert runs its gate and up as one
    packed GEMM (as every aserve MLP does), whose sums round apart from HF's two in the last
    bits."""
    hf_block, cfg = hf_blocks(name)
    holder = load_block(hf_block, aserve_block(name, cfg), tmp_path)
    x = torch.randn(1, 53, HIDDEN)
    with torch.no_grad():
        want = hf_block(x)
        want = want[0] if isinstance(want, tuple) else want
        got = holder.mlp(x[0])
        weights, ids = hf_route(hf_block, x[0])
        routed = holder.mlp.experts(x[0], weights.float(), ids)
        assert torch.equal(routed, hf_block.experts(x[0], ids, weights))
    if holder.mlp.shared_expert is None:
        assert torch.equal(got, want[0])
    else:
        torch.testing.assert_close(got, want[0], rtol=1e-6, atol=1e-5)


def test_gpt_oss_experts_clamp_and_de_interleave(tmp_path):
    """The swiglu limit bites on these inputs (lifting it changes HF's output), and the fused
    [E, H, 2I] gate/up columns alternate: a plain split would not match."""
    hf_block, cfg = hf_blocks("gpt_oss")
    x = torch.randn(1, 53, HIDDEN) * 3
    with torch.no_grad():
        want = hf_block(x)[0][0]
        hf_block.experts.limit = 1e9
        assert not torch.allclose(hf_block(x)[0][0], want)
        hf_block.experts.limit = cfg.swiglu_limit
    holder = load_block(hf_block, aserve_block("gpt_oss", cfg), tmp_path)
    with torch.no_grad():
        assert torch.equal(holder.mlp(x[0]), want)


def test_fused_and_per_expert_checkpoints_load_the_same_weights(moe_dir_factory, tmp_path):
    from aserve.config import ModelConfig

    per_expert = moe_dir_factory("qwen2_moe")
    fused = moe_dir_factory("qwen2_moe", fused_experts=True)
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        assert any(k.endswith("experts.gate_up_proj") for k in f.keys())
    a, _ = loader.load_model(ModelConfig(str(per_expert)))
    b, _ = loader.load_model(ModelConfig(str(fused)))
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), name


class ReadSpy:
    """Wraps safetensors' `safe_open`: records the names whose tensors (or slices) were read."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __call__(self, path, **kwargs):
        spy, handle = self, safe_open(path, **kwargs)

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_tensor(self, name):
                spy.read.append(name)
                return handle.get_tensor(name)

            def get_slice(self, name):
                spy.read.append(name)
                return handle.get_slice(name)

        return Handle()


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_an_expert_parallel_rank_reads_and_holds_only_its_experts(moe_dir_factory, monkeypatch,
                                                                   fused):
    from aserve.config import ModelConfig

    model_dir = moe_dir_factory("mixtral", fused_experts=fused)  # 5 experts: rank 1 holds 3, 4
    full, _ = loader.load_model(ModelConfig(str(model_dir)))
    spy = ReadSpy()
    monkeypatch.setattr(loader, "safe_open", spy)
    set_ep(1, 2)
    try:
        rank1, _ = loader.load_model(ModelConfig(str(model_dir)))
    finally:
        set_ep(0, 1)
    experts = [m for m in rank1.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.local_experts == range(3, 5) for m in experts)
    whole = [m for m in full.modules() if isinstance(m, FusedMoE)]
    for mine, all_of_them in zip(experts, whole, strict=True):
        assert torch.equal(mine.w13_weight, all_of_them.w13_weight[3:5])
        assert torch.equal(mine.w2_weight, all_of_them.w2_weight[3:5])
        assert mine.expert_map.tolist() == [-1, -1, -1, 0, 1]
    assert not [n for n in spy.read if any(f"experts.{e}." in n for e in range(3))]


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_missing_expert_tensor_is_named(moe_dir_factory, tmp_path):
    from aserve.config import ModelConfig

    model_dir = _copy_model(moe_dir_factory("mixtral"), tmp_path / "m")
    path = model_dir / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()
                   if k != "model.layers.1.block_sparse_moe.experts.3.w3.weight"}
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.3\.up"):
        loader.load_model(ModelConfig(str(model_dir)))


def _config_with(model_dir: Path, tmp_path: Path, **changes) -> Path:
    out = _copy_model(model_dir, tmp_path / "changed")
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("changes, message", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "method 'mxfp4' is not supported"),
    ({"n_group": 8, "topk_group": 4}, "grouped top-k"),
    ({"scoring_func": "sigmoid"}, "'sigmoid' expert scoring"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
])
def test_moe_configs_aserve_cannot_run_are_refused_naming_why(moe_dir_factory, tmp_path,
                                                              changes, message):
    model_dir = _config_with(moe_dir_factory("qwen3_moe"), tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        loader.read_arch_config(model_dir)


def test_the_expert_count_comes_from_whichever_key_the_config_uses(moe_dir_factory, tmp_path):
    cfg = json.loads((moe_dir_factory("qwen3_moe") / "config.json").read_text())
    counts = {cfg.pop(k) for k in ("num_experts", "num_local_experts") if k in cfg}
    (count,) = counts
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        assert ModelArchConfig.from_hf({**cfg, key: count}).moe.num_experts == count
    assert ModelArchConfig.from_hf(cfg).moe.num_experts == 128  # none: transformers' default


@pytest.mark.parametrize("platform", ["ref", "triton", "cpu-bf16"])
def test_a_rank_holding_no_expert_adds_nothing(platform):
    """3 experts over 4 expert-parallel ranks: the last holds none."""
    from aserve.backends.cpu_ops import cpu_kernel_ops
    from aserve.backends.ops import REF_OPS, ExpertWeights
    from aserve.backends.triton_ops import triton_kernel_ops

    dtype = torch.bfloat16 if platform == "cpu-bf16" else torch.float32
    ops = {"ref": lambda: REF_OPS, "triton": lambda: triton_kernel_ops(dtype),
           "cpu-bf16": lambda: cpu_kernel_ops(dtype)}[platform]()
    weights = ExpertWeights(w13=torch.empty(0, 32, 16, dtype=dtype),
                            w2=torch.empty(0, 16, 16, dtype=dtype),
                            expert_map=torch.full((3,), -1, dtype=torch.int32))
    x = torch.randn(5, 16, dtype=dtype)
    ids = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1], [0, 1]])
    out = ops.fused_moe(weights)(x, torch.rand(5, 2), ids)
    assert out.shape == x.shape and not out.any()
