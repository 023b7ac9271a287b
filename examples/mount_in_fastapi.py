"""Mount aserve's OpenAI-compatible app inside your own FastAPI service, under `/llm`.

    python examples/mount_in_fastapi.py --model /path/to/model --port 8001
    curl localhost:8001/                                   # the parent's own route
    # a browser on localhost:8001/llm/ gets the playground; /llm/dashboard the dashboard
    curl localhost:8001/llm/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "llm", "prompt": "Hello", "max_tokens": 16}'

Starlette (hence FastAPI) does not run a mounted sub-app's lifespan, so the parent's lifespan
enters `aserve_lifespan(llm_app)`: the engine starts with the parent and stops with it.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI

from aserve.engine.arg_utils import EngineArgs
from aserve.server import ServerConfig, aserve_lifespan, build_app


def make_app(model_dir: str, api_key: str | None = None, **engine_kwargs) -> FastAPI:
    llm_app = build_app(EngineArgs(model=str(model_dir), **engine_kwargs),
                        ServerConfig(served_model_name="llm", api_key=api_key))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with aserve_lifespan(llm_app):  # load the model; stop the engine on exit
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/")
    async def index() -> dict[str, str]:
        return {"service": "my-app"}

    app.mount("/llm", llm_app)  # /llm/v1/completions, /llm/v1/chat/completions, /llm/health
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    ns = parser.parse_args()
    uvicorn.run(make_app(ns.model), host=ns.host, port=ns.port)


if __name__ == "__main__":
    main()
