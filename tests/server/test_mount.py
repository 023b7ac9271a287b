"""examples/mount_in_fastapi.py: aserve mounted under /llm of a FastAPI app, engine included."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import openai
import pytest
from helpers.server import serving

pytestmark = pytest.mark.spawns  # a uvicorn server on a port

pytest.importorskip("fastapi")
EXAMPLE = Path(__file__).parents[2] / "examples" / "mount_in_fastapi.py"


def load_example():
    spec = importlib.util.spec_from_file_location("mount_in_fastapi", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mounted_app_serves_beside_the_parent_routes(model_dir_factory):
    app = load_example().make_app(model_dir_factory("llama"), dtype="float32",
                                  max_model_len=256)
    with serving(app) as url:
        assert httpx.get(f"{url}/").json() == {"service": "my-app"}
        assert httpx.get(f"{url}/llm/health").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/llm/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="llm", prompt="Hello", max_tokens=4,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4 and out.model == "llm"
        assert [m.id for m in client.models.list().data] == ["llm"]
