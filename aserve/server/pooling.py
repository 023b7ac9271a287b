"""The pooling runner's routes (`--runner pooling`): `POST /v1/embeddings`, `/v1/score` (and
`/score`), `/rerank` (and `/v1/rerank`, `/v2/rerank`).

Each embeds its texts (or token ids) through the engine, one pooling request per text, every one
tokenized and checked before any reaches the engine (a bad one adds nothing): the engine's
processor refuses them on a model the generate runner serves, naming `--runner pooling`. A score
is the cosine similarity of two texts' embeddings, as vLLM scores with an embedding model.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from aserve.engine.outputs import PoolingRequestOutput
from aserve.engine.processor import PreparedRequest
from aserve.engine.scoring import cosine, pair_indices
from aserve.pooling_params import PoolingParams
from aserve.server.errors import ServerError
from aserve.server.metrics import RequestTracker
from aserve.server.pooling_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from aserve.server.protocol import make_id
from aserve.server.serving import (
    check_capacity,
    check_model,
    parse_body,
    process_prompt,
    running_engine,
    server_state,
    until_disconnected,
)


async def create_embedding(request: Request) -> Response:
    body = await parse_body(request, EmbeddingRequest)
    check_model(request, body.model)
    engine = running_engine(request)
    try:
        params = body.to_pooling_params()
    except ValueError as e:
        raise ServerError.from_value_error(e) from e
    inputs = body.inputs()
    pooled = await embed(request, engine, inputs, ["input"] * len(inputs), params,
                         body.priority, body.add_special_tokens)
    data = [EmbeddingData.of(p.outputs.data, i, body.encoding_format)
            for i, p in enumerate(pooled)]
    return JSONResponse(EmbeddingResponse(model=server_state(request).model_name, data=data,
                                          usage=_usage(pooled)).model_dump())


async def create_score(request: Request) -> Response:
    body = await parse_body(request, ScoreRequest)
    check_model(request, body.model)
    engine = running_engine(request)
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    try:
        pairs = pair_indices(len(firsts), len(seconds))
    except ValueError as e:
        raise ServerError.from_value_error(e) from e
    pooled = await embed(request, engine, [*firsts, *seconds],
                         ["text_1"] * len(firsts) + ["text_2"] * len(seconds), PoolingParams(),
                         body.priority)
    one, two = pooled[:len(firsts)], pooled[len(firsts):]
    data = [ScoreData(index=k, score=cosine(one[i].outputs.data, two[j].outputs.data))
            for k, (i, j) in enumerate(pairs)]
    return JSONResponse(ScoreResponse(model=server_state(request).model_name, data=data,
                                      usage=_usage(pooled)).model_dump())


async def create_rerank(request: Request) -> Response:
    body = await parse_body(request, RerankRequest)
    check_model(request, body.model)
    engine = running_engine(request)
    texts = body.texts()
    pooled = await embed(request, engine, [body.query, *texts],
                         ["query"] + ["documents"] * len(texts), PoolingParams(), body.priority)
    query = pooled[0].outputs.data
    scores = [cosine(query, p.outputs.data) for p in pooled[1:]]
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[:body.top_n or len(texts)]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=texts[i])
                            if body.return_documents else None) for i in order]
    usage = RerankUsage(total_tokens=_usage(pooled).total_tokens)
    return JSONResponse(RerankResponse(model=server_state(request).model_name, usage=usage,
                                       results=results).model_dump())


def _usage(pooled: list[PoolingRequestOutput]) -> PoolingUsage:
    tokens = sum(len(p.prompt_token_ids) for p in pooled)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


async def embed(request: Request, engine: AsyncEngine, inputs: list[str | list[int]],
                fields: list[str], params: PoolingParams, priority: int,
                add_special_tokens: bool = True) -> list[PoolingRequestOutput]:
    """Each input's pooled output, in order. Every input is tokenized and checked first (a
    400 naming its field in `fields`), then all are added and awaited; the client leaving, the
    request timeout or the engine dying aborts them all."""
    prepared: list[PreparedRequest] = []
    for text, field in zip(inputs, fields, strict=True):
        prompt = await process_prompt(engine, text, add_special_tokens, param=field)
        try:
            prepared.append(await engine.prepare(prompt, params, priority))
        except ValueError as e:
            raise ServerError.from_value_error(e) from e
        except EngineDeadError as e:
            raise ServerError(str(e), 503) from e
    streams, trackers = _start(request, engine, prepared, fields[-1])
    try:
        outputs = await _collect(request, streams)
    except BaseException:
        for tracker in trackers:
            tracker.on_finish("abort")
        raise
    for tracker in trackers:
        tracker.on_finish("stop")
    return outputs


def _start(request: Request, engine: AsyncEngine, prepared: list[PreparedRequest],
           field: str) -> tuple[list[RequestStream], list[RequestTracker]]:
    state = server_state(request)
    limit = state.engine_args.max_num_seqs + state.config.max_waiting_requests
    if len(prepared) > limit:  # (more than could ever wait: no retry would succeed)
        raise ServerError(f"The request holds {len(prepared)} texts to embed, more than the "
                          f"server ever admits at once ({limit}).", 400, field)
    check_capacity(request, engine, len(prepared))  # 503 + Retry-After when busy now
    request_id = make_id("pool")
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prepared):
            streams.append(engine.add(f"{request_id}-{i}", p))
    except (ValueError, EngineDeadError) as e:
        for stream in streams:
            stream.abort()
        raise ServerError(str(e), 503 if isinstance(e, EngineDeadError) else 400) from e
    return streams, [state.metrics.track(len(p.prompt.prompt_token_ids)) for p in prepared]


async def _last(stream: RequestStream) -> PoolingRequestOutput | None:
    """A pooling request's one output (None: its stream ended without one)."""
    last = None
    async for output in stream:
        last = output
    return last


async def _collect(request: Request, streams: list[RequestStream]
                   ) -> list[PoolingRequestOutput]:
    """Every stream's one output; aborts them all when the client disconnects (499), past the
    request timeout (504) or when the engine dies (503)."""
    gathered = asyncio.ensure_future(asyncio.gather(*map(_last, streams)))
    watcher = asyncio.create_task(until_disconnected(request))
    timeout = server_state(request).config.request_timeout
    try:
        done, _ = await asyncio.wait({gathered, watcher}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if gathered not in done:
            gathered.cancel()
            if watcher in done:
                raise ServerError("The client disconnected.", 499)
            raise ServerError("The request did not finish within the server's request "
                              "timeout; it was aborted.", 504)
        outputs = gathered.result()
    except EngineDeadError as e:
        raise ServerError(str(e), 503) from e
    finally:
        gathered.cancel()  # (its waits on streams the engine no longer serves, if any)
        for stream in streams:
            stream.abort()  # (a no-op for a finished one)
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if any(o is None or o.outputs is None for o in outputs):
        raise ServerError("The request was aborted before it was pooled (the server is "
                          "shutting down).", 503)
    return outputs
