"""`EngineArgs`: every knob of the engine in one flat dataclass, as users and the CLI give them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from aserve.config import (
    MOE_COMBINES,
    CacheConfig,
    DraftConfig,
    KVCacheGroupSpec,
    KVTransferConfig,
    ModelConfig,
    PrefillPolicy,
    SchedulerConfig,
    SpeculativeConfig,
    SpeculativeConfigError,
)
from aserve.engine.runner_choice import choose_pooler
from aserve.executor.spec import RankLayout, WorkerSpec
from aserve.quantization import QUANTIZATION_NAMES
from aserve.quantization.gguf_file import (  # noqa: F401 (GGUFError, model_source: the server's)
    GGUFError,
    gguf_model_dir,
    is_gguf,
    model_source,
)


class KVTransferConfigError(ValueError):
    """`kv_transfer_config` is malformed or names what aserve does not have (the CLI exits 1)."""


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    # A quantized checkpoint (GGUF) loaded as floats of `dtype` instead of kept as integers
    # for the integer GEMM where the platform has one (the float reference path)
    dequantize: bool = False
    # The checkpoint's quantization method as vLLM names it (`--quantization`): None detects
    # it; a name is checked against the checkpoint at load (aserve quantizes no float weights)
    quantization: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # Token budget of one step; None: the platform's (CPU 512, GPUs 4096), once it is known.
    max_num_batched_tokens: int | None = None
    # The prefill knobs: `PrefillPolicy` (aserve/config.py) defines and explains them.
    long_prefill_token_threshold: int = PrefillPolicy.long_prefill_token_threshold
    max_prefill_step_ratio: float = PrefillPolicy.max_prefill_step_ratio
    prefill_cap_decodes: int = PrefillPolicy.prefill_cap_decodes
    prefill_first_streams: int = PrefillPolicy.prefill_first_streams
    max_mixed_step_ratio: float = PrefillPolicy.max_mixed_step_ratio
    scheduling_policy: str = "fcfs"
    async_scheduling: bool = True
    block_size: int = 16
    enable_prefix_caching: bool = True
    # KV cache size: num_kv_blocks, else kv_cache_memory bytes, else the platform's default
    # (CPU: min(2 GiB, half the available memory)), else (GPUs) profiled under this utilization.
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    device: str = "auto"  # auto | cuda | rocm | xla | cpu
    served_model_name: str | None = None
    # vLLM's --runner: generate (sample tokens) | pooling (embed: /v1/embeddings, score, rerank;
    # prefill only, no LM head) | auto (pooling for a sentence-transformers directory or a bare
    # decoder, `engine/runner_choice.py`)
    runner: str = "auto"
    enforce_eager: bool = False  # never capture decode graphs (CUDA/HIP)
    # Two dummy prompts run before the engine serves (EngineCore._warm_up): the first user's
    # steps are not cold, and the prefill budget's step costs are known from the start
    warmup: bool = True
    tensor_parallel_size: int = 1  # ranks splitting each layer; spawned by this process
    pipeline_parallel_size: int = 1  # stages of consecutive layers, a batch per stage in flight
    pp_layer_partition: str | None = None  # layers per stage, e.g. "10,20"; None: even split
    # MoE layers hold whole experts per TP rank (attention stays tensor-parallel); a dense model
    # has nothing to place, so it changes nothing there (as in vLLM)
    enable_expert_parallel: bool = False
    # JSON constraints allow free whitespace between tokens (vLLM's default). Off by default:
    # JSON comes out compact (", " and ": " separators), and a weak model cannot loop on
    # whitespace; a request's structured_outputs.disable_any_whitespace always wins.
    structured_outputs_any_whitespace: bool = False
    moe_combine: str = "all-reduce"  # how expert-parallel outputs meet: all-reduce | all-to-all
    # Ulysses: ranks splitting each step's tokens outside attention (heads inside it); world =
    # pp × sp × tp ranks
    sequence_parallel_size: int = 1
    # Disaggregated prefill: a KV connector, as vLLM's --kv-transfer-config (its JSON text, a
    # dict of its keys or a KVTransferConfig: a KVTransferConfig once constructed); None: none
    kv_transfer_config: KVTransferConfig | dict | str | None = None
    # Speculative decoding, as vLLM's --speculative-config (its JSON text, a dict of its keys
    # or a SpeculativeConfig: a SpeculativeConfig once constructed); None: none. It turns
    # async scheduling off: a step's drafts follow the tokens of the step before.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Several nodes: one `python -m aserve` per node, each starting its share of the ranks; node
    # 0 serves. Defaults come from torchrun's variables (NNODES, NODE_RANK / GROUP_RANK,
    # MASTER_ADDR, MASTER_PORT) when set.
    nnodes: int = field(default_factory=lambda: int(os.environ.get("NNODES", 1)))
    node_rank: int = field(default_factory=lambda: int(
        os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0))))
    master_addr: str = field(default_factory=lambda: os.environ.get("MASTER_ADDR", "127.0.0.1"))
    master_port: int | None = field(default_factory=lambda: int(os.environ["MASTER_PORT"])
                                    if "MASTER_PORT" in os.environ else None)

    def __post_init__(self) -> None:
        if self.model and is_gguf(self.model):  # served from a directory of its metadata
            self.served_model_name = self.served_model_name or self.model
            self.model = str(gguf_model_dir(self.model))
        if self.quantization is not None and self.quantization not in QUANTIZATION_NAMES:
            raise ValueError(f"quantization {self.quantization!r} is not a method aserve reads "
                             f"(one of {', '.join(QUANTIZATION_NAMES)}).")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1.")
        self._check_sequence_parallel()
        world_size = self.world_size
        if self.nnodes < 1 or world_size % self.nnodes or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"{world_size} ranks cannot be split over nnodes={self.nnodes} "
                             f"(node_rank={self.node_rank}): every node runs world/nnodes ranks.")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need --master-port (and --master-addr: node 0's "
                             "address), the same on every node.")
        if self.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be at least 1.")
        if self.moe_combine not in MOE_COMBINES:
            raise ValueError(f"moe_combine {self.moe_combine!r} must be one of "
                             f"{', '.join(MOE_COMBINES)}.")
        self._check_kv_transfer_config()
        if self.speculative_config is not None:
            self._check_speculative_config()
        # the pooling runner's defaults; None: the generate runner
        self.pooler = choose_pooler(self.model, self.runner)
        if self.pooler is not None:
            self._check_pooling()
        if self.pp_layer_partition is not None:
            parts = self.pp_layer_partition.split(",")
            if len(parts) != self.pipeline_parallel_size or not all(
                    p.strip().isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"pp_layer_partition {self.pp_layer_partition!r} must be "
                                 f"{self.pipeline_parallel_size} positive layer counts, "
                                 "comma-separated (one per pipeline stage).")

    def _check_kv_transfer_config(self) -> None:
        if self.kv_transfer_config is None:
            return
        from aserve.kv_transfer import check_config  # (torch: only when configured)

        try:
            self.kv_transfer_config = KVTransferConfig.from_value(self.kv_transfer_config)
            check_config(self.kv_transfer_config)
        except ValueError as e:
            raise KVTransferConfigError(str(e)) from None
        if self.pipeline_parallel_size > 1 or self.sequence_parallel_size > 1:
            raise KVTransferConfigError("kv_transfer_config does not work with pipeline or "
                                        "sequence parallelism yet (pipeline_parallel_size or "
                                        "sequence_parallel_size > 1).")

    def _check_speculative_config(self) -> None:
        spec = SpeculativeConfig.from_value(self.speculative_config)
        if spec.runner_drafts:
            path = Path(spec.model).expanduser()
            gguf = spec.method == "draft_model" and is_gguf(str(path))
            if not (gguf or (path / "config.json").is_file()):
                wanted = ("a model directory (config.json) or a GGUF file"
                          if spec.method == "draft_model"
                          else "an EAGLE head's directory (config.json)")
                raise SpeculativeConfigError(f"speculative_config.model {spec.model!r} is not "
                                             f"{wanted}.")
            spec = replace(spec, model=str(gguf_model_dir(str(path)) if gguf else path))
        self.speculative_config = spec

    def _check_pooling(self) -> None:
        """What the pooling runner does not combine with (refused at startup, by name): it
        pools rank 0's final hidden states, which tensor parallelism replicates but pipeline
        stages and sequence-parallel slices do not hold; it samples nothing to draft or
        transfer."""
        refused = [name for name, on in (
            ("pipeline_parallel_size > 1", self.pipeline_parallel_size > 1),
            ("sequence_parallel_size > 1", self.sequence_parallel_size > 1),
            ("speculative_config", self.speculative_config is not None),
            ("kv_transfer_config", self.kv_transfer_config is not None)) if on]
        if refused:
            raise ValueError(f"the pooling runner does not work with {', '.join(refused)}.")

    def _check_sequence_parallel(self) -> None:
        """What sequence parallelism needs of the other flags (the heads it splits are checked
        when the model is built: `aserve/layers/ulysses.py`)."""
        sp = self.sequence_parallel_size
        if sp < 1:
            raise ValueError("sequence_parallel_size must be at least 1.")
        if sp > 1 and self.enable_expert_parallel and self.moe_combine != "all-to-all":
            raise ValueError("--sequence-parallel-size with --enable-expert-parallel needs "
                             "--moe-combine all-to-all: each SP rank holds other tokens, so "
                             "the experts' partial sums cannot meet in one all-reduce.")

    @property
    def world_size(self) -> int:
        return (self.tensor_parallel_size * self.sequence_parallel_size
                * self.pipeline_parallel_size)

    def model_config(self) -> ModelConfig:
        return ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                           max_model_len=self.max_model_len, seed=self.seed,
                           served_model_name=self.served_model_name,
                           dequantize=self.dequantize, quantization=self.quantization,
                           pooler=self.pooler)

    def worker_spec(self) -> WorkerSpec:
        """What every rank builds."""
        spec = self.speculative_config
        draft = None
        if spec is not None and spec.runner_drafts:
            draft = DraftConfig(ModelConfig(model=spec.model, dtype=self.dtype, seed=self.seed,
                                            dequantize=self.dequantize),
                                spec.method, spec.num_speculative_tokens)
        return WorkerSpec(self.model_config(), self.block_size, self.device, self.enforce_eager,
                          self.max_num_seqs, self.kv_transfer_config, draft,
                          spec.num_speculative_tokens if spec is not None else 0)

    def rank_layout(self) -> RankLayout:
        """pp × sp × tp ranks over `nnodes` nodes."""
        partition = self.pp_layer_partition
        return RankLayout(
            self.world_size, self.tensor_parallel_size,
            self.nnodes, self.master_addr, self.master_port,
            tuple(int(n) for n in partition.split(",")) if partition else None,
            self.enable_expert_parallel, self.moe_combine, self.sequence_parallel_size)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            prefill=PrefillPolicy(**{f.name: getattr(self, f.name)
                                     for f in fields(PrefillPolicy)}),
            policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
            max_batches_in_flight=self.max_batches_in_flight,
            speculative=self.speculative_config,
        )

    @property
    def max_batches_in_flight(self) -> int:
        """One batch per pipeline stage when scheduling is async; else one."""
        return self.pipeline_parallel_size if self.async_scheduling else 1

    def cache_config(self, num_blocks: int,
                     kv_cache_groups: tuple[KVCacheGroupSpec, ...] = ()) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_blocks=num_blocks,
                           enable_prefix_caching=self.enable_prefix_caching,
                           kv_cache_groups=kv_cache_groups)
