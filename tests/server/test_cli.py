"""`python -m aserve` as users run it: a real process serving HTTP, its errors, its flags."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from helpers.server import free_port, wait_healthy

from aserve.engine.arg_utils import EngineArgs
from aserve.server.cli import build_parser, engine_args_from, main, parse_args, server_config_from


def run_cli(*args: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aserve", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.spawns
def test_serves_the_api_with_a_key_and_exits_0_on_sigterm(model_dir_factory, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "stderr.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aserve", "--model", str(model_dir_factory("llama")),
             "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
             "--served-model-name", "tiny-cli", "--api-key", "secret"],
            stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_healthy(proc, url)
        body = {"model": "tiny-cli", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        key = {"Authorization": "Bearer secret"}
        out = httpx.post(f"{url}/v1/completions", json=body, headers=key, timeout=30)
        assert out.status_code == 200
        assert out.json()["usage"]["completion_tokens"] == 4
        assert isinstance(out.json()["choices"][0]["text"], str)
        models = httpx.get(f"{url}/v1/models", headers=key).json()
        assert [m["id"] for m in models["data"]] == ["tiny-cli"]
        api_tour(url, "tiny-cli", "secret")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"serving tiny-cli on {url}" in log.read_text()


def api_tour(url: str, model: str, key: str) -> None:
    """The API beyond completions, through the openai SDK, as a client of `python -m aserve`
    meets it: the model's card, echo-scoring with max_tokens 0, the Responses API (plain,
    streamed, a function tool, a JSON schema, retrieved)."""
    import json

    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=key)
    assert client.models.retrieve(model).id == model
    scored = client.completions.create(model=model, prompt="Hello there", max_tokens=0,
                                       echo=True, logprobs=0)
    assert scored.choices[0].text == "Hello there" and scored.usage.completion_tokens == 0
    plain = client.responses.create(model=model, input="Hi", max_output_tokens=4,
                                    temperature=0)
    assert plain.output_text and plain.usage.output_tokens <= 4
    events = list(client.responses.create(model=model, input="Hi", max_output_tokens=4,
                                          temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == plain.output_text
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    called = client.responses.create(
        model=model, input="Weather?", max_output_tokens=40,
        tools=[{"type": "function", "name": "weather", "parameters": schema}],
        tool_choice={"type": "function", "name": "weather"})
    jsonschema.validate(json.loads(called.output[0].arguments), schema)
    formatted = client.responses.create(
        model=model, input="City?", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    jsonschema.validate(json.loads(formatted.output_text), schema)
    assert client.responses.retrieve(formatted.id).output_text == formatted.output_text


@pytest.mark.spawns
def test_serves_embeddings_score_and_rerank_of_an_embedding_model(tmp_path):
    """`python -m aserve MODEL` on a sentence-transformers directory (a bare Qwen3Model, last
    token, normalised) picks the pooling runner itself; the SDK's embeddings equal HF's, and
    score / rerank are the cosines of those embeddings."""
    import torch
    from helpers.pooling_models import hf_embeddings, make_embedding_model
    from openai import OpenAI

    model_dir = make_embedding_model(tmp_path / "embed", "qwen3", pooling="last")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "aserve", str(model_dir), "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "128",
                             "--served-model-name", "embed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, url)
        prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
        out = OpenAI(base_url=f"{url}/v1", api_key="none").embeddings.create(
            model="embed", input=prompts)
        got = torch.tensor([d.embedding for d in out.data])
        expected = hf_embeddings(model_dir, prompts, "last")
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        texts = ["a cat", "a dog", "the sea"]
        score = httpx.post(f"{url}/v1/score", json={"model": "embed", "text_1": texts[0],
                                                     "text_2": texts[1:]}).json()
        rerank = httpx.post(f"{url}/v1/rerank", json={"model": "embed", "query": texts[0],
                                                       "documents": texts[1:]}).json()
        scores = [d["score"] for d in score["data"]]
        assert sorted(scores, reverse=True) == [r["relevance_score"] for r in rerank["results"]]
        assert all(-1 <= x <= 1 for x in scores)
        chat = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "embed", "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 400 and "--runner" in chat.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.spawns
def test_without_a_model_it_serves_the_built_in_demo_model():
    """The README's first command: `python -m aserve`, then a curl to /v1/completions. The
    first thing it says is that it is loading the model, the banner comes once it serves."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "aserve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        models = httpx.get(f"{url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["aserve-demo"]
        out = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "prompt": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
            "max_tokens": 16, "temperature": 0}).json()
        assert out["choices"][0]["text"].strip()
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}).json()
        assert chat["choices"][0]["message"]["content"].strip()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        reader.join(timeout=10)
        said = [line for line in lines if "aserve" in line]
        assert "loading aserve-demo" in said[0], lines
        banner = next(i for i, line in enumerate(said) if "serving aserve-demo on" in line)
        assert banner > 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.spawns
@pytest.mark.parametrize("model", ["/nonexistent/model/dir", "no-such-org/no-such-model"])
def test_unknown_model_offline_is_one_error_line_and_exit_2(model, tmp_path):
    result = run_cli("--model", model,
                     env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and model in lines[0]


@pytest.mark.spawns
def test_a_model_dir_without_weights_fails_with_one_error_line(model_dir_factory, tmp_path):
    broken = tmp_path / "no-weights"
    shutil.copytree(model_dir_factory("llama"), broken,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    result = run_cli("--model", broken, "--port", free_port(), "--dtype", "float32")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: ")
    assert "Traceback" not in result.stderr


def test_flags_map_onto_engine_args_and_server_config(monkeypatch):
    monkeypatch.setenv("ASERVE_API_KEY", "from-env")
    ns = build_parser().parse_args([
        "--model", "m", "--kv-cache-memory", "512MiB", "--no-enable-prefix-caching",
        "--max-num-seqs", "8", "--scheduling-policy", "priority", "--seed", "0",
        "--allowed-origins", "http://a,http://b", "--allowed-origins", "http://c"])
    args = engine_args_from(ns)
    assert args == EngineArgs(model="m", kv_cache_memory=512 << 20, enable_prefix_caching=False,
                              max_num_seqs=8, scheduling_policy="priority")
    config = server_config_from(ns)
    assert config.allowed_origins == ["http://a", "http://b", "http://c"]
    assert config.api_key == "from-env"
    assert server_config_from(build_parser().parse_args(["--api-key", "k"])).api_key == "k"
    assert not config.disable_frontend
    assert server_config_from(build_parser().parse_args(["--disable-frontend"])).disable_frontend
    assert config.max_stored_responses == 1024
    assert server_config_from(build_parser().parse_args(
        ["--max-stored-responses", "0"])).max_stored_responses == 0


@pytest.mark.parametrize("text,expected", [("1024", 1024), ("4GiB", 4 << 30), ("4G", 4 << 30),
                                           ("512MB", 512 * 10**6), ("1.5KiB", 1536)])
def test_kv_cache_memory_accepts_sizes_with_units(text, expected):
    ns = build_parser().parse_args(["--kv-cache-memory", text])
    assert ns.kv_cache_memory == expected



def test_kv_cache_memory_rejects_a_size_it_cannot_read(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--kv-cache-memory", "4 parsecs"])
    assert exit_info.value.code == 2 and "not a size in bytes" in capsys.readouterr().err


def test_vllm_command_lines_parse_the_same():
    """`aserve serve MODEL` / `aserve MODEL` and vLLM's flag names for the same knobs."""
    ns = parse_args(["serve", "org/name", "--kv-cache-memory-bytes", "1GiB",
                     "--num-gpu-blocks-override", "7", "-tp", "2"])
    args = engine_args_from(ns)
    assert (args.model, args.kv_cache_memory, args.num_kv_blocks,
            args.tensor_parallel_size) == ("org/name", 2**30, 7, 2)
    assert parse_args(["some/dir", "--port", "9"]).model == "some/dir"
    assert parse_args(["--port", "9", "some/dir"]).model == "some/dir"
    assert parse_args(["serve", "--model", "m", "m"]).model == "m"  # the same, twice
    assert parse_args(["serve"]).model is None  # the demo model


def test_two_different_models_are_one_error_line_and_exit_2(capsys):
    assert main(["serve", "one", "--model", "two"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "two models" in err


def test_runs_from_the_folder_that_holds_a_clone_named_aserve(tmp_path):
    """There `aserve` is first the clone's folder (a namespace package): `python -m aserve`
    still runs the installed package."""
    (tmp_path / "aserve").mkdir()  # a clone: no __init__.py at its top
    (tmp_path / "aserve" / "README.md").write_text("a clone\n")
    out = subprocess.run([sys.executable, "-m", "aserve", "--version"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("aserve ")
