"""The small routes: models, tokenize / detokenize, metrics. (Generation lives in
`completions.py` and `chat.py`; health and version in `app.py`.)"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aserve.engine.arg_utils import model_source
from aserve.server.chat import render_chat
from aserve.server.errors import ServerError
from aserve.server.metrics import CONTENT_TYPE
from aserve.server.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
)
from aserve.server.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from aserve.server.serving import check_model, parse_body, running_engine, server_state


def _model_card(request: Request) -> ModelCard:
    state = server_state(request)
    engine = running_engine(request)
    return ModelCard(id=state.model_name, root=model_source(state.engine_args.model),
                     max_model_len=engine.model_info.max_model_len,
                     quantization=engine.model_info.quantization)


async def list_models(request: Request) -> Response:
    return JSONResponse(ModelList(data=[_model_card(request)]).model_dump())


async def retrieve_model(request: Request) -> Response:
    """`GET /v1/models/{id}` (the id may hold slashes: `org/name`): the served model's card,
    else 404."""
    model_id = request.path_params["model_id"]
    check_model(request, model_id)
    return JSONResponse(_model_card(request).model_dump())


async def tokenize(request: Request) -> Response:
    body = await parse_body(request, TokenizeRequest)
    check_model(request, body.model)
    engine = running_engine(request)
    text = body.prompt if body.prompt is not None else await render_chat(request, engine, body)
    try:
        tokens = await engine.encode(text, add_special_tokens=body.add_special_tokens)
    except ValueError as e:
        raise ServerError(str(e), 400, "prompt" if body.prompt is not None else "messages") from e
    return JSONResponse(TokenizeResponse(tokens=tokens, count=len(tokens),
                                         max_model_len=engine.model_info.max_model_len)
                        .model_dump())


async def detokenize(request: Request) -> Response:
    body = await parse_body(request, DetokenizeRequest)
    check_model(request, body.model)
    engine = running_engine(request)
    try:
        engine.processor.check_token_ids(body.tokens, "tokens")
    except ValueError as e:
        raise ServerError(str(e), 400, "tokens") from e
    text = engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)
