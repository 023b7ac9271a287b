"""Frozen configuration dataclasses shared by every package.

`SchedulerConfig` (with its `PrefillPolicy`) and `CacheConfig` hold numbers only: they are what
`aserve/core` sees.
`ModelConfig` names files and dtypes and is read by the model side only; `DistributedConfig`
places one rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class PrefillPolicy:
    """How many prompt tokens one step may prefill: the one place the prefill knobs (each an
    `EngineArgs` field and CLI flag of the same name) and their constants are defined.
    `core/step_cost.py: prefill_token_cap` applies them with the step cost the scheduler fits
    to the steps that ran, seconds ≈ a + b · tokens + c · attention keys, so that a / b is a
    step's fixed cost in tokens; P below is in those tokens, a chunk after C computed tokens
    costing its tokens and c / b per key it reads (`step_cost.chunk_cost`), D the decodes'
    cost so counted. With D streams decoding (requests past their prompt) and P prefill
    tokens (chunks of running prefills and admissions together) in a step:

        a chunk                            P_request ≤ long_prefill_token_threshold (0: any)
        D = 0 or D ≤ prefill_first_streams P ≤ the whole budget
        more streams                       P ≤ ratio · a / b, never under one block;
                                           ratio = max_prefill_step_ratio, times
                                           prefill_cap_decodes / D once D is above it
          and with max_mixed_step_ratio r  P ≤ max((r − 1)(a / b + D),
                                                   pending prompt tokens / drain_steps(D))

    A mixed step of P prefill tokens beside D decodes costs a + b (D + P): the first cap keeps
    it within the decodes alone plus `ratio` fixed costs, the second within r times the
    decodes alone, unless the prompts pending (the whole prompts of running prefills and
    waiting requests, past their cached prefix) need more to be prefilled within
    `drain_steps(D)` steps. Every stream waits out a mixed step, so a prompt is spread over
    more, shorter steps the more streams it would stall, yet always ends (it drains at one
    rate), and prompts cannot queue faster than they are admitted. With few streams nothing
    caps prefill: few readers wait out the step, and a long prompt among them reaches its
    first token sooner. Until the fit makes both costs positive the cap is half the budget; a
    runner that reports no step times gets no cap. What each knob does to latency and
    throughput: docs/benchmarks/serving-latency.md ("Inter-token latency tails", "Stutter under
    many streams", "Spreading a prompt over the steps", "Prefill first among few streams").
    """

    # 0: a prefill chunk is bounded by the budget only.
    long_prefill_token_threshold: int = 0
    # Prefill beside decodes costs at most this many times a step's fixed cost. 0: no cap.
    max_prefill_step_ratio: float = 2.0
    # With 1 to this many streams decoding, prefill has the whole budget. 0: off.
    prefill_first_streams: int = 3
    # With more streams decoding than this, the ratio shrinks by this / their number (lower
    # inter-token tails, slower admission). 0: off.
    prefill_cap_decodes: int = 0
    # A mixed step costs at most this many times its decodes alone, unless the prompts
    # pending need more. 0: off; else above 1.
    max_mixed_step_ratio: float = 2.0

    # drain_steps(D) = min(DRAIN_STEPS_PER_DECODE · D, PREFILL_DRAIN_STEPS)
    DRAIN_STEPS_PER_DECODE: ClassVar[int] = 2
    PREFILL_DRAIN_STEPS: ClassVar[int] = 32

    def __post_init__(self) -> None:
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0.")
        if self.max_prefill_step_ratio < 0:
            raise ValueError("max_prefill_step_ratio must be >= 0 (0: off), got "
                             f"{self.max_prefill_step_ratio}.")
        if self.max_mixed_step_ratio != 0 and self.max_mixed_step_ratio <= 1:
            raise ValueError("max_mixed_step_ratio must be above 1 (0: off), got "
                             f"{self.max_mixed_step_ratio}.")
        if self.prefill_first_streams < 0:
            raise ValueError("prefill_first_streams must be >= 0 (0: off), got "
                             f"{self.prefill_first_streams}.")
        if self.prefill_cap_decodes < 0:
            raise ValueError("prefill_cap_decodes must be >= 0 (0: off), got "
                             f"{self.prefill_cap_decodes}.")

    def step_ratio(self, num_decoding: int) -> float:
        """The fixed costs a step's prefill may take beside `num_decoding` streams; 0: no
        cap (no decodes, few streams, or the ratio off)."""
        ratio = self.max_prefill_step_ratio
        if ratio <= 0 or not num_decoding or num_decoding <= self.prefill_first_streams:
            return 0.0
        streams = self.prefill_cap_decodes
        if streams and num_decoding > streams:
            ratio *= streams / num_decoding
        return ratio

    def drain_steps(self, num_decoding: int) -> int:
        """The steps within which the prompts pending must be prefilled, beside
        `num_decoding` streams."""
        return min(self.DRAIN_STEPS_PER_DECODE * num_decoding, self.PREFILL_DRAIN_STEPS)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    prefill: PrefillPolicy = field(default_factory=PrefillPolicy)
    policy: str = "fcfs"  # "fcfs" | "priority"
    # Schedule step N+1 while step N runs: a request that samples in step N is scheduled again
    # with a placeholder for the token it has not received yet (see Scheduler).
    async_scheduling: bool = False
    # Batches in flight at once (pipeline stages). Above 1 a request waits for its token in
    # flight before it is scheduled again: consecutive batches hold different requests.
    max_batches_in_flight: int = 1
    # Drafts after each step (core/speculation.py); None: a token a step. Under async
    # scheduling a request that would draft waits for its token in flight (its drafts follow
    # it); the others overlap as without speculation.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}.")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers whose KV cache is managed as one: the same attention kind and window, one block
    table per request. `layers` are model layer indices (every stage's); a group's i-th layer
    uses the runner's KV buffer i, shared with the i-th layer of every other group."""

    layers: tuple[int, ...]
    sliding_window: int | None = None  # None: full attention (every earlier key is visible)
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}.")

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else "sliding"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # decided by the runner from memory; a count given here wins
    enable_prefix_caching: bool = True
    # One entry per KV cache group (see `aserve.core.kv_cache_utils.make_kv_cache_groups`);
    # empty: one full-attention group of every layer.
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}.")
        for group in self.kv_cache_groups:
            if group.block_size != self.block_size:
                raise ValueError(f"KV cache group {group} has block size {group.block_size}, "
                                 f"not the cache's {self.block_size}.")

    @property
    def groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return self.kv_cache_groups or (KVCacheGroupSpec((), None, self.block_size),)


RUNNERS = ("auto", "generate", "pooling")  # `--runner`, vLLM's
# Bare decoders (HF's `*Model`: no LM head) of the families aserve serves -> their causal LM,
# whose stack they are: served by the pooling runner only (embedding checkpoints such as
# Qwen3-Embedding; their weights may lack the `model.` prefix)
BARE_DECODERS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "MixtralModel": "MixtralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "Qwen2MoeModel": "Qwen2MoeForCausalLM",
    "Qwen3MoeModel": "Qwen3MoeForCausalLM",
    "Gemma2Model": "Gemma2ForCausalLM",
    "Gemma3TextModel": "Gemma3ForCausalLM",
}


@dataclass(frozen=True)
class PoolerConfig:
    """A pooling model's defaults, for requests that leave them unset: its pooling type
    (`pooling_params.POOLING_TYPES`) and whether vectors are L2-normalised. Read from a
    sentence-transformers directory (`engine/runner_choice.py`), else vLLM's for decoders:
    the last token, normalised."""

    pooling_type: str = "LAST"
    normalize: bool = True


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # "auto" follows config.json; else float32 / bfloat16 / float16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    served_model_name: str | None = None
    # A quantized checkpoint's weights as floats of `dtype`, not kept as integers for the
    # platform's integer GEMM (the float reference path; float32 always is)
    dequantize: bool = False
    quantization: str | None = None  # --quantization: checked against the checkpoint
    # The pooling runner's defaults (`--runner pooling`): the model is built without its LM
    # head and every request is pooled (`runner/pooler.py`); None: the generate runner
    pooler: PoolerConfig | None = None

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model


@dataclass(frozen=True)
class DraftConfig:
    """What every rank builds for a speculative method whose drafts its runner proposes
    (`SpeculativeConfig.runner_drafts`): the draft model or EAGLE head and k."""

    model: ModelConfig
    method: str  # draft_model | eagle | eagle3
    num_tokens: int


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a loaded model, handed up by the executor."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    # The platform's step token budget, for an engine given none.
    default_max_num_batched_tokens: int = 4096
    # Per model layer: its sliding window, None for full attention (empty: all full).
    layer_windows: tuple[int | None, ...] = ()
    # What a KV block's bytes depend on (the model's weights and config, dtype, block size,
    # the tensor-parallel layout): KV stored under another key is never loaded here.
    kv_cache_key: str = ""
    # What quantization runs (None: a float checkpoint): the checkpoint's method or GGUF
    # types, and how its weights run (the integer GEMM, or dequantized to the dtype)
    quantization: str | None = None
    hidden_size: int = 0  # what a pooled vector holds (before `dimensions`)
    pooler: PoolerConfig | None = None  # the pooling runner's defaults; None: it generates


MOE_COMBINES = ("all-reduce", "all-to-all")  # how expert-parallel outputs meet
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config` / `LLM(kv_transfer_config=...)`: vLLM's keys, as vLLM spells them.

    `kv_connector` names the connector (`aserve.kv_transfer.CONNECTORS`; the engine checks
    it), `kv_role` what this instance does: produce KV (a prefill instance), consume it (a
    decode instance) or both. `kv_ip` / `kv_port` are where a peer-to-peer producer listens
    (rank r of its tensor-parallel group on `kv_port + r`); `engine_id` names this instance
    in the `kv_transfer_params` it hands out (None: a random id). vLLM's other top-level keys
    (`kv_buffer_device`, `kv_buffer_size`, `kv_rank`, `kv_parallel_size`,
    `kv_connector_module_path`) are accepted and unused; any other key is refused.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict, hash=False, compare=False)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str | None = None
    kv_buffer_device: str | None = None
    kv_buffer_size: float | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_connector_module_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError("kv_transfer_config.kv_connector must name a connector, got "
                             f"{self.kv_connector!r}.")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {self.kv_role!r}.")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON "
                             "object.")
        if (not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool)
                or not 0 < self.kv_port < 65536):
            raise ValueError(f"kv_transfer_config.kv_port must be a TCP port, got "
                             f"{self.kv_port!r}.")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_value(cls, value: KVTransferConfig | dict | str) -> KVTransferConfig:
        """From itself, a dict of vLLM's keys, or their JSON text; a ValueError names what
        is wrong (malformed JSON, an unknown key, a bad role)."""
        if isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config is not valid JSON: {e}.") from None
        if not isinstance(value, dict):
            raise ValueError("kv_transfer_config must be a JSON object, got "
                             f"{type(value).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown keys {unknown}; known: "
                             f"{', '.join(sorted(known))}.")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config needs kv_connector.")
        return cls(**value)


@dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits: `rank` of `world_size` (`local_rank` on its node), TCP
    rendezvous at rank 0's address."""

    rank: int
    world_size: int
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: str = "gloo"  # the model's collectives: "nccl" on GPUs, "gloo" on CPU
    timeout_s: float = 600.0
    tp_size: int = 0  # tensor-parallel ranks; 0: the whole world over sp_size (no pipeline)
    sp_size: int = 1  # sequence-parallel ranks; a pipeline stage is sp_size * tp_size ranks
    pp_layer_partition: tuple[int, ...] | None = None  # layers per stage; None: even split
    enable_expert_parallel: bool = False  # MoE layers: whole experts per TP rank
    moe_combine: str = "all-reduce"  # expert parallelism: "all-reduce" or "all-to-all"


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts model's routing and expert shapes (`models/moe_config.py` reads them
    from the HF config; `layers/moe.py` builds from them)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each routed expert's
    sparse_layers: tuple[bool, ...]  # per layer: a MoE block (True) or the dense MLP
    scoring: str = "softmax"  # softmax | topk_softmax (`aserve.kernels.moe.select_experts`)
    renormalize: bool = False  # top-k weights rescaled to sum to 1
    round_weights: bool = False  # weights rounded to the model dtype (HF's Qwen-MoE)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated shared expert
    activation: str = "silu"  # silu | swiglu_oai (`aserve.kernels.moe.apply_activation`)
    swiglu_alpha: float = 1.702
    swiglu_limit: float | None = None
    expert_bias: bool = False  # gpt-oss: biased expert projections
    router_bias: bool = False  # gpt-oss: a biased router
    interleaved_gate_up: bool = False  # gpt-oss' fused checkpoint: [E, H, 2I], gate/up alternating


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3")
# methods whose drafts the runner proposes, from a model of their own (`model`)
RUNNER_SPECULATIVE_METHODS = ("draft_model", "eagle", "eagle3")
LATER_SPECULATIVE_METHODS = ("mtp", "medusa", "mlp_speculator")  # vLLM's: refused by name
MAX_SPECULATIVE_TOKENS = 32  # drafts a step: each costs a row of logits and a KV slot


class SpeculativeConfigError(ValueError):
    """`speculative_config` is malformed or names what aserve does not run (exit 1)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config '<json>'` / `LLM(speculative_config=...)`, vLLM's keys: which
    method drafts tokens and how many a step (docs/design.md §8, "Speculative decoding")."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    # n-gram lookup: the longest suffix of prompt_lookup_max .. prompt_lookup_min tokens that
    # occurred earlier in the sequence proposes the tokens that followed it
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    # suffix decoding: the longest suffix of the recent tokens (up to max_tree_depth) found in
    # the request's own tokens and in recent requests' outputs (max_cached_requests of them)
    # proposes its most frequent continuation while that path's probability stays at or above
    # min_token_prob, up to max_spec_factor x the match's length; num_speculative_tokens
    # defaults to max_tree_depth (at most MAX_SPECULATIVE_TOKENS)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model: a smaller model with the target's vocabulary (an HF directory or a GGUF
    # file), drafting greedily on the target's block tables with KV buffers of its own;
    # eagle / eagle3: an EAGLE head's directory (vLLM's checkpoint formats), the same way
    model: str | None = None

    @property
    def runner_drafts(self) -> bool:
        """Whether the runner's own model proposes the drafts (after each step)."""
        return self.method in RUNNER_SPECULATIVE_METHODS

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str) -> SpeculativeConfig:
        """A config from its JSON text, a dict of vLLM's keys, or itself; checked."""
        if isinstance(value, SpeculativeConfig):
            config = value
        else:
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise SpeculativeConfigError(
                        f"speculative_config is not valid JSON: {e}.") from None
            if not isinstance(value, dict):
                raise SpeculativeConfigError("speculative_config must be a JSON object, got "
                                             f"{type(value).__name__}.")
            config = cls._from_dict(dict(value))
        config.check()
        return config

    @classmethod
    def _from_dict(cls, value: dict[str, Any]) -> SpeculativeConfig:
        method = value.pop("method", None)
        if value.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
            value.pop("model")
            method = method or "ngram"
        if method is None:
            method = "draft_model" if value.get("model") is not None else "ngram"
        if method in LATER_SPECULATIVE_METHODS:
            raise SpeculativeConfigError(
                f"speculative_config.method {method!r} is not supported yet; methods aserve "
                f"runs: {', '.join(SPECULATIVE_METHODS)}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config has keys aserve does not know or run: {unknown}; known: "
                f"method, {', '.join(sorted(known - {'method'}))}.")
        for key, item in value.items():
            if key == "model":
                if not isinstance(item, str) or not item:
                    raise SpeculativeConfigError("speculative_config.model must be a path.")
                continue
            real = key in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
            if not isinstance(item, (int, float) if real else int) or isinstance(item, bool):
                raise SpeculativeConfigError(f"speculative_config.{key} must be "
                                             f"{'a number' if real else 'an integer'}, got "
                                             f"{item!r}.")
        if method == "suffix" and "num_speculative_tokens" not in value:
            value["num_speculative_tokens"] = min(
                value.get("suffix_decoding_max_tree_depth", cls.suffix_decoding_max_tree_depth),
                MAX_SPECULATIVE_TOKENS)
        if "prompt_lookup_max" in value and "prompt_lookup_min" not in value:
            value["prompt_lookup_min"] = min(cls.prompt_lookup_min, value["prompt_lookup_max"])
        if "prompt_lookup_min" in value and "prompt_lookup_max" not in value:
            value["prompt_lookup_max"] = max(cls.prompt_lookup_max, value["prompt_lookup_min"])
        return cls(method=method, **value)

    def check(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise SpeculativeConfigError(
                f"speculative_config.method {self.method!r} is not one aserve runs "
                f"({', '.join(SPECULATIVE_METHODS)}).")
        if self.runner_drafts != (self.model is not None):
            raise SpeculativeConfigError(
                "speculative_config: methods draft_model, eagle and eagle3 take a model (its "
                "path), and only they.")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                "speculative_config.num_speculative_tokens must be within 1 .. "
                f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}.")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise SpeculativeConfigError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, "
                f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}.")
        for key, low, high in (("suffix_decoding_max_tree_depth", 1, 256),
                               ("suffix_decoding_max_cached_requests", 0, 100_000),
                               ("suffix_decoding_max_spec_factor", 0.0, 64.0),
                               ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            if not low <= getattr(self, key) <= high:
                raise SpeculativeConfigError(f"speculative_config.{key} must be within {low} .. "
                                             f"{high}, got {getattr(self, key)}.")
