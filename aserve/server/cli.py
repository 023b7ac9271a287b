"""Command line: `python -m aserve --model M` serves the OpenAI-compatible API over HTTP.

    python -m aserve                                   # the built-in demo model, or
    python -m aserve --model /path/to/model            # a local HF directory, or
    python -m aserve --model /path/to/model.gguf       # a GGUF file, or
    python -m aserve --model org/name                  # a Hugging Face hub id (cache first)
    python -m aserve --model M --prompt "Hello"        # generate offline and print, no server
    aserve serve M  |  aserve M                        # vLLM's habits: the model positional

Every `EngineArgs` field is a flag of the same name (`max_num_seqs` -> `--max-num-seqs`), and
vLLM's names of the same knobs are aliases (`--kv-cache-memory-bytes`,
`--num-gpu-blocks-override`); the frontend's own settings (`--host`, `--api-key`, ...) fill a
`ServerConfig`. SIGINT or SIGTERM
stops the server gracefully (in-flight requests get `--shutdown-timeout` seconds, then are
aborted) and the process exits 0; `launch.py` runs the app.

Exit codes: 0 served or generated; 1 the engine or the socket failed, a bad
`--kv-transfer-config` (unknown connector or role, malformed JSON, no storage path) or a GGUF
file aserve cannot serve; 2 bad arguments or a model that cannot be found (`hub.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aserve
from aserve.assets import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from aserve.engine.arg_utils import (
    EngineArgs,
    GGUFError,
    KVTransferConfigError,
    SpeculativeConfigError,
)
from aserve.sampling_params import SamplingParams
from aserve.server.connections import add_connection_args, connection_limits_from, raise_fd_limit
from aserve.server.hub import ModelNotFound, resolve_model
from aserve.server.reasoning_parsers import REASONING_PARSERS
from aserve.server.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:  # the server side imports torch: load it only once arguments are valid

    from aserve.server.app import ServerConfig

DEFAULT_MODEL = str(DEMO_MODEL_DIR)  # served when no --model is given
API_KEY_ENV = "ASERVE_API_KEY"
LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]

ENGINE_HELP = {
    "kv_transfer_config": "disaggregated prefill: a KV connector, as JSON with vLLM's keys, "
                          "e.g. '{\"kv_connector\": \"P2pConnector\", \"kv_role\": "
                          "\"kv_producer\", \"kv_port\": 14579}' or SharedStorageConnector "
                          "with kv_connector_extra_config.shared_storage_path; kv_role "
                          "kv_producer | kv_consumer | kv_both; P2pConnector needs the shared "
                          "secret in $ASERVE_KV_SECRET (default: none)",
    "speculative_config": "speculative decoding, as JSON with vLLM's keys, e.g. "
                          "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                          "\"prompt_lookup_max\": 5, \"prompt_lookup_min\": 2}' (n-gram "
                          "lookup in the request's own tokens; turns async scheduling off; "
                          "default: none)",
    "model": "a HF model directory (config.json, *.safetensors, tokenizer.json) or a hub id "
             "org/name, downloaded into the HF cache unless HF_HUB_OFFLINE=1 (default: the "
             "built-in demo model, served as aserve-demo)",
    "tokenizer": "tokenizer directory or hub id (default: the model's)",
    "dtype": "auto (config.json's) | float32 | bfloat16 | float16",
    "quantization": "the checkpoint's quantization method as vLLM names it (gguf, gptq, awq, "
                    "compressed-tensors, fp8; awq_marlin, gptq_marlin); checked against the "
                    "checkpoint (default: read from it; aserve quantizes no float weights)",
    "dequantize": "a quantized model (GGUF) runs on floats of --dtype, dequantized at load, "
                  "instead of keeping its weights as integers for the int4 / int8 GEMM where "
                  "the CPU has one (the float reference path)",
    "max_model_len": "longest prompt + completion in tokens (default: the model's maximum)",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one engine step (decodes + prefill chunks) "
                              "(default: the platform's: 512 on CPU, 4096 on GPUs)",
    "long_prefill_token_threshold": "cap one request's prefill chunk per step (0: no cap)",
    "max_prefill_step_ratio": "in a step that carries decodes, cap prefill tokens at what "
                              "costs this many times a step's fixed cost, measured (0: no cap)",
    "prefill_cap_decodes": "with more than N streams decoding in a step, scale that cap by "
                           "N / streams (lower ITL tails, slower admission; 0: off)",
    "prefill_first_streams": "with N streams decoding or fewer, prefill chunks get the whole "
                             "step budget (sooner first tokens, longer stalls; 0: off)",
    "max_mixed_step_ratio": "a step that carries prefill and decodes costs at most this many "
                            "times its decodes alone, measured, unless the prompts pending need "
                            "more to be prefilled within 2 steps a stream, at most 32 (0: off)",
    "scheduling_policy": "fcfs | priority (lower `priority` values are served first)",
    "block_size": "tokens per KV cache block",
    "enable_prefix_caching": "reuse the KV blocks of prompts' shared prefixes",
    "kv_cache_memory": "bytes for the KV cache: 2147483648, 4GiB, 512MiB, 1.5G (K/M/G/T are "
                       "binary, KB/MB/GB/TB decimal) (default: on CPU min(2GiB, half the "
                       "available memory); on GPUs what --gpu-memory-utilization leaves)",
    "gpu_memory_utilization": "share of GPU memory aserve may use in all (weights, activations, "
                              "KV cache); ignored on CPU",
    "async_scheduling": "schedule the next step while the current one runs",
    "enforce_eager": "run every step eagerly: no CUDA/HIP graphs of decode batches",
    "warmup": "before serving, run two dummy prompts (the step budget, then half of it "
              "beside a decode): the first users' steps are not cold, and the prefill cap "
              "knows the step costs from the start",
    "tensor_parallel_size": "ranks that split every layer (heads, FFN columns/rows, vocab); "
                            "this process spawns ranks 1..N-1",
    "pipeline_parallel_size": "pipeline stages, each a run of consecutive layers on its own "
                              "ranks (with async scheduling, one batch per stage in flight)",
    "pp_layer_partition": "layers per pipeline stage, comma-separated, e.g. 10,20 (default: "
                          "an even split)",
    "enable_expert_parallel": "MoE models: each tensor-parallel rank holds whole experts "
                              "(E / tp, uneven counts allowed) instead of a slice of every "
                              "expert; attention stays tensor-parallel; no effect on a dense "
                              "model",
    "moe_combine": "with --enable-expert-parallel: all-reduce (every rank routes every token) "
                   "| all-to-all (each rank's share of the tokens travels to its experts' "
                   "ranks and back)",
    "sequence_parallel_size": "Ulysses sequence parallelism: ranks that split each step's "
                              "tokens (embedding, norms, MLP / MoE) and trade them for heads "
                              "around attention (each rank's KV cache holds a share of the "
                              "heads); world = pp x sp x tp ranks",
    "structured_outputs_any_whitespace": "JSON constraints (response_format, "
        "structured_outputs.json) allow free whitespace between JSON tokens, as vLLM does "
        "(default: compact JSON, on which a weak model cannot loop on whitespace)",
    "nnodes": "nodes the ranks are spread over (one `python -m aserve` per node; default: "
              "$NNODES or 1)",
    "node_rank": "this node's index; node 0 serves HTTP, the others run ranks only (default: "
                 "$NODE_RANK / $GROUP_RANK or 0)",
    "master_addr": "node 0's address for the rendezvous (default: $MASTER_ADDR or 127.0.0.1)",
    "master_port": "rendezvous port, the same on every node (default: $MASTER_PORT, else a "
                   "free port on one node)",
    "num_kv_blocks": "number of KV cache blocks (overrides --kv-cache-memory)",
    "seed": "seed of the sampler's random generator",
    "device": "auto (ROCm, else CUDA, else XLA, else CPU) | cuda | rocm | xla | cpu",
    "served_model_name": "the model's name in the API (default: --model as given)",
    "runner": "auto | generate (completions, chat) | pooling (/v1/embeddings, /v1/score, "
              "/rerank: the model's final hidden states pooled, no LM head); auto pools for a "
              "sentence-transformers directory or a bare *Model decoder (default: auto)",
}


SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",)}
# vLLM's flags for the same knobs, so that its command lines run unchanged
VLLM_FLAGS = {"kv_cache_memory": ("--kv-cache-memory-bytes",),
              "num_kv_blocks": ("--num-gpu-blocks-override",)}


class UsageError(Exception):
    """Bad arguments: one line on stderr, exit code 2 (as a model that cannot be found)."""


# ---------------------------------------------------------------------------------- arguments

_UNITS = {"": 1, "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "kb": 10**3,
          "m": 1 << 20, "mi": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "gb": 10**9,
          "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """`4GiB` -> 4 * 2**30; `512MB` -> 512 * 10**6; `1.5G` -> 1.5 * 2**30; `1024` -> 1024."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and _UNITS.get(match.group(2).lower())
    if unit is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4GiB, 512MiB)")
    return int(float(match.group(1)) * unit)


_METAVARS: dict[Any, str] = {int: "N", float: "X", parse_bytes: "BYTES"}


def _flag_type(name: str, annotation: str) -> Callable[[str], Any]:
    if name == "kv_cache_memory":
        return parse_bytes
    for kind in (bool, int, float):
        if kind.__name__ in str(annotation).split(" | "):
            return kind
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineArgs` field, so a new engine knob is a new flag without edits here."""
    group = parser.add_argument_group("engine")
    defaults = EngineArgs(model="")
    for f in dataclasses.fields(EngineArgs):
        flag, default = "--" + f.name.replace("_", "-"), getattr(defaults, f.name)
        help_text = ENGINE_HELP.get(f.name, f"EngineArgs.{f.name}")
        if default is not None and default != "" and "default:" not in help_text:
            help_text += f" (default: {default})"
        kind = _flag_type(f.name, f.type)
        flags = [flag, *SHORT_FLAGS.get(f.name, ()), *VLLM_FLAGS.get(f.name, ())]
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        else:
            group.add_argument(*flags, type=kind, default=None if f.name == "model" else default,
                               help=help_text, metavar=_METAVARS.get(kind, f.name.upper()))


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1, this machine only; "
                            "0.0.0.0 listens on every interface)")
    group.add_argument("--port", type=int, default=8000, metavar="N", help="(default: 8000)")
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help=f"require `Authorization: Bearer KEY` on /v1 routes, /tokenize "
                            f"and /detokenize (default: ${API_KEY_ENV} if set, else no key)")
    group.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                       help="a Jinja chat template, or a file holding one (default: the "
                            "tokenizer's)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template in /v1/chat/completions and /tokenize "
                            "requests (each rendered within size and time bounds); without it "
                            "such a request is a 400 (default: off)")
    group.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGINS",
                       help="CORS origins allowed to call the API, comma-separated or repeated "
                            "(default: none, CORS off)")
    group.add_argument("--max-waiting-requests", type=int, default=512, metavar="N",
                       help="requests (completions) allowed to wait beyond --max-num-seqs; "
                            "more are refused at once with 503 + Retry-After (default: 512)")
    group.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                       help="abort a request that has not finished after this long: 504, or "
                            "an error event when streaming (default: none)")
    group.add_argument("--stream-stall-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="abort a streamed request whose client has read nothing for this "
                            "long (its socket buffers full), freeing its slots and KV blocks, "
                            "and close the connection; 0: never (default: 30)")
    group.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, time in-flight requests get to finish before "
                            "they are aborted (finish_reason \"abort\") (default: 10)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='accepted for vLLM compatibility: tool_choice "auto" (the default '
                            "with tools) is always on")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the model's tool-call format (default: the one its chat template "
                            "renders tools with; hermes when it shows none): "
                            + ", ".join(sorted(TOOL_PARSERS)))
    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split a reasoning model's <think>...</think> into "
                            "message.reasoning_content: deepseek_r1, qwen3")
    group.add_argument("--disable-frontend", action="store_true",
                       help="serve no web pages: no playground at /, no dashboard at "
                            "/dashboard, nor their files and figures (all 404)")
    group.add_argument("--max-stored-responses", type=int, default=1024,
                       help="the Responses API's stored responses kept in memory, least "
                            "recently used out (0: none is stored; default 1024)")
    add_connection_args(group)  # --timeout-header-read, --timeout-keep-alive, --max-connections
    group.add_argument("--uvicorn-log-level", choices=LOG_LEVELS, default="info",
                       help="log level of uvicorn and aserve (default: info)")


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("offline generation (no server)")
    group.add_argument("--prompt", action="append", default=None,
                       help="generate a completion of this prompt and exit (repeat for several)")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"aserve {aserve.__version__}")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model takes it (vLLM's `vllm serve MODEL`)")
    add_engine_args(parser)
    add_server_args(parser)
    add_offline_args(parser)
    return parser


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def server_config_from(ns: argparse.Namespace) -> ServerConfig:
    from aserve.server.app import ServerConfig

    origins = [o.strip() for arg in ns.allowed_origins for o in arg.split(",") if o.strip()]
    if ns.max_waiting_requests < 0:
        raise UsageError("--max-waiting-requests must be >= 0")
    if ns.request_timeout is not None and ns.request_timeout <= 0:
        raise UsageError("--request-timeout must be > 0")
    if ns.stream_stall_timeout < 0:
        raise UsageError("--stream-stall-timeout must be >= 0")
    if ns.max_stored_responses < 0:
        raise UsageError("--max-stored-responses must be >= 0")
    return ServerConfig(served_model_name=ns.served_model_name,
                        api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None,
                        chat_template=ns.chat_template,
                        trust_request_chat_template=ns.trust_request_chat_template,
                        allowed_origins=origins,
                        max_waiting_requests=ns.max_waiting_requests,
                        request_timeout=ns.request_timeout,
                        stream_stall_timeout=ns.stream_stall_timeout or None,
                        enable_auto_tool_choice=ns.enable_auto_tool_choice,
                        tool_call_parser=ns.tool_call_parser,
                        reasoning_parser=ns.reasoning_parser,
                        disable_frontend=ns.disable_frontend,
                        max_stored_responses=ns.max_stored_responses)


# ---------------------------------------------------------------------------------- offline

def generate_offline(engine_args: EngineArgs, ns: argparse.Namespace) -> int:
    from aserve.engine.llm import LLM  # imports torch: only once arguments are valid

    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                            top_p=ns.top_p, top_k=ns.top_k)
    llm = LLM(**dataclasses.asdict(engine_args))
    for out in llm.generate(ns.prompt, params):
        completion = out.outputs[0]
        if ns.json:
            print(json.dumps({"prompt": out.prompt, "text": completion.text,
                              "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{out.prompt}{completion.text}")
    return 0


# ---------------------------------------------------------------------------------- other nodes

def run_worker_node(engine_args: EngineArgs) -> int:
    """Nodes 1..nnodes-1 serve no HTTP: they run their ranks until node 0 stops them."""
    from aserve.engine.core import run_worker_node as run_ranks

    print(f"aserve {aserve.__version__} node {engine_args.node_rank}/{engine_args.nnodes}: "
          f"ranks joining {engine_args.master_addr}:{engine_args.master_port}",
          file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_ranks(engine_args)
    return 0


# ---------------------------------------------------------------------------------- serving

def serve(engine_args: EngineArgs, ns: argparse.Namespace) -> int:
    import uvicorn

    from aserve.engine.async_engine import EngineDeadError
    from aserve.server.app import build_app
    from aserve.server.launch import (
        ABORT_MARGIN_S,
        bind,
        configure_logging,
        exit_on_signal,
        serve_until_stopped,
        signal_handlers,
    )

    try:
        app = build_app(engine_args, server_config_from(ns))
    except OSError as e:  # --chat-template names a file that cannot be read
        raise UsageError(f"--chat-template: {e}") from None
    limits = connection_limits_from(ns)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                            lifespan="off",
                            timeout_graceful_shutdown=ns.shutdown_timeout + ABORT_MARGIN_S,
                            **limits.uvicorn_options())
    log_filter = configure_logging(ns.uvicorn_log_level)
    logging.getLogger("aserve").info(  # at once: loading takes seconds, a first start more
        "loading %s (%s) ...", app.state.aserve.model_name, engine_args.model)
    raise_fd_limit(limits.max_connections)
    try:
        sock = bind(ns.host, ns.port)
        host = f"[{ns.host}]" if ":" in ns.host else ns.host
        banner = (f"aserve {aserve.__version__} serving {app.state.aserve.model_name} on "
                  f"http://{host}:{sock.getsockname()[1]}")
        with sock, signal_handlers(exit_on_signal, signal.SIGTERM):
            asyncio.run(serve_until_stopped(app, uvicorn.Server(config), sock, banner,
                                            log_filter, ns.shutdown_timeout))
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        return 130
    except (EngineDeadError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, `serve` first or not (`aserve serve MODEL ...`, as `vllm serve`), the
    model positional or `--model`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    ns = build_parser().parse_args(argv)
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise UsageError(f"two models: {ns.model_tag!r} and --model {ns.model!r}; give "
                             "one")
        ns.model = ns.model_tag
    return ns


def main(argv: list[str] | None = None) -> int:
    try:
        ns = parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        model = ns.model or DEFAULT_MODEL
        ns.model = resolve_model(model)
        # a hub id, not its cache path; the demo model under its own stable name
        ns.served_model_name = ns.served_model_name or (
            model if ns.model != DEFAULT_MODEL else DEMO_MODEL_NAME)
        if ns.tokenizer is not None:
            ns.tokenizer = resolve_model(ns.tokenizer)
        engine_args = engine_args_from(ns)
        if engine_args.node_rank > 0:
            return run_worker_node(engine_args)
        if ns.prompt:
            return generate_offline(engine_args, ns)
        return serve(engine_args, ns)
    except (KVTransferConfigError, SpeculativeConfigError, GGUFError) as e:  # startup: exit 1
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (UsageError, ModelNotFound, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
