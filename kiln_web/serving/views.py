"""OpenAI-compatible endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

Async Django views, so a streamed answer (server-sent events) flows under the ASGI server
token by token. Each view authenticates the bearer token, brings this process's serving
pool in step with the database, and runs tokenisation and generation on the serving
threads (generation is numpy and native kernels, which release the GIL), never on the
event loop. A client that disconnects mid-stream stops its generation at the next token.

A caller is served, and listed, only the adapters they may use (Adapter.objects.visible_to: their own, those
shared with them, all for staff); any other adapter's name is answered exactly as a name that does not exist
(404 model_not_found), so the names of other people's adapters do not leak.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from kiln_web.accounts.actions import authenticate_token
from kiln_web.core.http import NOT_JSON, STATUS, ActionRefused, json_body
from kiln_web.serving import completions as oai
from kiln_web.serving import runtime
from kiln_web.serving.runtime import SamplingConfig, ServingError

logger = logging.getLogger("kiln.serving")


class StreamClosed(Exception):
    """Raised inside generation when the client has gone."""


def _error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    """The OpenAI-compatible error shape: the API's {"error": {code, message}} plus OpenAI's type and param."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return {"error": {"code": code, "message": message, "type": kind, "param": param}}


def _error(status: int, code: str, message: str, param: str | None = None) -> JsonResponse:
    response = JsonResponse(_error_body(status, code, message, param), status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="kiln"'
    return response


def _serving_error(error: ServingError) -> JsonResponse:
    return _error(STATUS.get(error.code, 400), error.code, error.message, param="model")


async def _user(request: HttpRequest):
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return await sync_to_async(authenticate_token)(token.strip())


async def _in_step() -> tuple:
    """This process's runtime, reconciled with the ServedAdapter rows; returns (runtime, wanted)."""
    serving = runtime.serving()
    wanted = await sync_to_async(runtime.wanted_adapters)()
    await asyncio.get_running_loop().run_in_executor(serving.executor, serving.reconcile, wanted)
    return serving, wanted


def _not_found(name: str) -> ServingError:
    """The one answer for a name that is neither a base nor an adapter the caller may use (names do not leak)."""
    return ServingError("model_not_found", f"no loaded adapter or registered base is named {name!r}; GET /v1/models "
                                           "lists those you may use, and POST /v1/adapters/NAME/load loads an adapter")


def _default(wanted: tuple, usable: frozenset, user_id: int) -> str:
    """What a request that names no model gets: the caller's own active adapter, else the server's default base
    (KILN_DEFAULT_BASE, else the first packaged base registered, else kiln-tiny); never anyone else's adapter."""
    from kiln_web.jobs.runtime import default_base

    active = next((w for w in wanted if w.active and w.scope == user_id and w.name in usable), None)
    if active is not None:
        return active.name
    base = default_base()
    if not runtime.is_base(base):
        raise ServingError("model_required", f"no adapter is active for you and the default base {base!r} is not "
                                             "registered; name a model (GET /v1/models lists them)")
    return base


def _resolve(serving: runtime.ServingRuntime, wanted: tuple, usable: frozenset, user_id: int, name: str | None):
    """The Served model for a request's `model`: a registered base (a base's name always means the base), or a
    loaded adapter the caller may use (USABLE: the names runtime.usable_adapters gave); with no model, _default.
    An adapter the caller may not use is refused exactly as a name that does not exist."""
    if name is None:
        name = _default(wanted, usable, user_id)
    if runtime.is_base(name):
        return serving.pool.base(name)
    if name not in usable:
        raise _not_found(name)
    if name not in serving.loaded_here():
        refusal = serving.refusal(name)
        if refusal is not None:
            raise ServingError("adapter_unavailable", f"adapter {name!r} cannot be served here: {refusal.message}")
        raise _not_found(name)
    return serving.pool.adapter(name)


def _prepare(serving, wanted, usable, user_id, request):
    served = _resolve(serving, wanted, usable, user_id, request.model or None)
    config = served.model.config
    plan = oai.plan_request(request, served.tokenizer, config.maximum_context, config.vocabulary_size,
                            settings.KILN_SERVING_MAX_TOKENS)
    return served, plan


def _generate(serving, served, plan, prompt, on_token=None):
    sampling = SamplingConfig(**oai.sampling_arguments(plan))
    _, generation = serving.pool.complete(None, prompt, sampling, seed=plan.seed, echo=plan.echo,
                                          on_token=on_token, top_logprobs=plan.logprobs or 0, served=served)
    return generation


def _generate_all(serving, served, plan):
    return [_generate(serving, served, plan, prompt) for prompt in plan.prompts]


async def _complete(request: HttpRequest, schema):
    if request.method != "POST":
        return _error(405, "method_not_allowed", "use POST")
    user = await _user(request)
    if user is None:
        return _error(401, "unauthorized", "a valid API token is required: send 'Authorization: Bearer <token>' "
                                           "(create one with: kiln token create --user NAME)")
    try:
        body = json_body(request.body or b"null", stored=False)  # a prompt may hold NUL: it is never stored
    except ActionRefused as refusal:
        return _error(refusal.status, refusal.code, refusal.message, refusal.extra.get("field"))
    except ValueError:
        return _error(400, "invalid_request", NOT_JSON)
    try:
        parsed = oai.parse_request(schema, body)
        serving, wanted = await _in_step()
        usable = await sync_to_async(runtime.usable_adapters)(user, wanted)
        loop = asyncio.get_running_loop()
        served, plan = await loop.run_in_executor(serving.executor, _prepare, serving, wanted, usable, user.pk,
                                                  parsed)
        if parsed.stream:
            response = StreamingHttpResponse(_events(serving, served, plan), content_type="text/event-stream")
            response["Cache-Control"] = "no-cache"
            response["X-Accel-Buffering"] = "no"
            return response
        generations = await loop.run_in_executor(serving.executor, _generate_all, serving, served, plan)
    except oai.RequestRefused as refused:
        return _error(400, refused.code, refused.message, refused.param)
    except ServingError as error:
        return _serving_error(error)
    except ValueError as error:  # SamplingConfig's checks
        return _error(400, "invalid_request", str(error))
    return JsonResponse(oai.response_body(plan, served.name, served.tokenizer, generations))


def _sse(data) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


async def _events(serving, served, plan):
    """Server-sent events: a chunk per piece of text that can no longer change, a final chunk with the
    finish reason, usage when asked for, then [DONE]."""
    loop = asyncio.get_running_loop()
    closed = threading.Event()
    generations, future = [], None
    try:
        for index, prompt in enumerate(plan.prompts):
            queue: asyncio.Queue = asyncio.Queue()
            text = oai.TextStream(plan, served.tokenizer)

            def on_token(token, logprob, top, text=text, queue=queue):
                if closed.is_set():
                    raise StreamClosed
                delta = text.push(token)
                loop.call_soon_threadsafe(queue.put_nowait, (token, logprob, top, delta))

            future = loop.run_in_executor(serving.executor, _generate, serving, served, plan, prompt, on_token)
            future.add_done_callback(lambda _, queue=queue: queue.put_nowait(None))
            if plan.chat:
                yield _sse(oai.chunk_body(plan, served.name, index, role=True))
            elif plan.echo:
                yield _sse(oai.chunk_body(plan, served.name, index, text=served.tokenizer.decode(prompt)))
            pending, offset = [], 0
            while (item := await queue.get()) is not None:
                token, logprob, top, delta = item
                pending.append((token, logprob, top))
                if delta:
                    logprobs = _chunk_logprobs(plan, served.tokenizer, pending, offset)
                    offset += sum(len(served.tokenizer.decode([t])) for t, _, _ in pending)
                    pending = []
                    yield _sse(oai.chunk_body(plan, served.name, index, text=delta, logprobs=logprobs))
            try:
                generation = future.result()
            except (ServingError, ValueError) as error:
                yield _sse(_error_body(400, getattr(error, "code", "invalid_request"),
                                       getattr(error, "message", str(error))))
                return
            except Exception:  # a bug: said to the client in the stream's own terms, not by a cut connection
                logger.exception("generation for %s failed mid-stream", served.name)
                yield _sse(_error_body(500, "internal_error", "the server failed while generating this answer; its "
                                                              "log has the details"))
                return
            generations.append(generation)
            if plan.max_new_tokens == 0:
                pending = []  # scoring the prompt: the one token generated is not part of the answer
            elif generation.tokens and generation.tokens[-1] in plan.stop_ids and pending:
                pending = pending[:-1]  # the stop token ends the answer without being part of it
            rest = text.finish(oai.completion_text(plan, served.tokenizer, generation.tokens))
            logprobs = _chunk_logprobs(plan, served.tokenizer, pending, offset) if (pending or rest) else None
            yield _sse(oai.chunk_body(plan, served.name, index, text=rest if (rest or not plan.chat) else None,
                                      finish=oai.finish_reason(plan, generation), logprobs=logprobs))
        if plan.include_usage:
            yield _sse(oai.usage_chunk(plan, served.name, generations))
        yield _sse(b"[DONE]")
    finally:
        closed.set()  # the client went away (or we are done): a running generation stops at its next token
        if future is not None and not future.done():
            future.add_done_callback(lambda done: done.cancelled() or done.exception())  # StreamClosed, expected


def _chunk_logprobs(plan, tokenizer, entries, offset):
    if plan.logprobs is None or not entries:
        return None
    if plan.chat:
        return oai.chat_logprobs(plan, tokenizer, entries)
    return oai.legacy_logprobs(plan, tokenizer, entries, offset)


@csrf_exempt
async def completions(request: HttpRequest):
    return await _complete(request, oai.CompletionRequest)


@csrf_exempt
async def chat_completions(request: HttpRequest):
    return await _complete(request, oai.ChatRequest)


async def models(request: HttpRequest):
    """The registered bases and the loaded adapters the caller may use, OpenAI's list shape; `kiln` says which
    is which."""
    if request.method != "GET":
        return _error(405, "method_not_allowed", "use GET")
    user = await _user(request)
    if user is None:
        return _error(401, "unauthorized", "a valid API token is required: send 'Authorization: Bearer <token>'")
    return JsonResponse(await sync_to_async(_model_list)(user))


def _model_list(user) -> dict:
    from kiln_web.adapters.models import Adapter
    from kiln_web.serving.models import ServedAdapter

    data = [{"id": name, "object": "model", "created": 0, "owned_by": "kiln",
             "kiln": {"kind": "base", "active": False, "base": None}} for name in runtime.base_names()]
    # `active`: the caller's own active adapter (what a request without a model gets), never someone else's
    usable = Adapter.objects.visible_to(user).values("pk")
    for row in ServedAdapter.objects.filter(adapter__in=usable).select_related("adapter__owner") \
            .order_by("adapter__name"):
        data.append({"id": row.adapter.name, "object": "model", "created": int(row.loaded_at.timestamp()),
                     "owned_by": row.adapter.owner.get_username(),
                     "kiln": {"kind": "adapter", "active": row.active and row.active_for_id == user.pk,
                              "base": row.base}})
    return {"object": "list", "data": data}
