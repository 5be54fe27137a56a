"""The OpenAI-compatible subset Kiln serves: request shapes, prompts, sampling, and response bodies.

Plain functions over a tokenizer and a trainer Generation; the HTTP side (kiln_web.serving.views)
runs them on the serving threads. Fields a client may send that would change the answer but
that Kiln does not implement (n > 1, penalties, logit_bias, suffix, best_of, tools, JSON mode) are refused
rather than ignored; any other unknown field is ignored, as OpenAI's own clients expect.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kiln_web.core.http import error_location, field_refusal
from trainer.generation import stop_token_ids

MAX_SEED = 2**63 - 1
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class RequestRefused(ValueError):
    """A request Kiln will not serve; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


# -- request shapes --


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="a base or a loaded adapter you may use; absent: your active "
                                                "adapter, else the default base")
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, ge=0, le=1, description="nucleus sampling; 0 keeps only the most probable token")
    top_k: int = Field(0, ge=-1, description="sample among the K most probable tokens (vLLM's extension); "
                                             "0 or -1: no limit")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="absent with temperature > 0: a random seed, "
                                                                   "reported back as kiln.seed")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise field_refusal("n", "Kiln returns one choice per prompt; send n=1 (or leave it out)")
        if self.presence_penalty or self.frequency_penalty:
            raise field_refusal("presence_penalty" if self.presence_penalty else "frequency_penalty",
                                "presence_penalty and frequency_penalty are not supported; leave them at 0")
        if self.logit_bias:
            raise field_refusal("logit_bias", "not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise field_refusal("response_format", "JSON mode and structured outputs are not supported; send "
                                                   "{\"type\": \"text\"} (or leave it out)")
        stops = self.stop_strings
        if len(stops) > 4 or any(not s for s in stops):
            raise field_refusal("stop", "at most 4 non-empty strings")
        return self

    @property
    def stop_strings(self) -> tuple:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # token ids are integers, never true/false
    echo: bool = Field(False, description="also return the prompt (and, with logprobs, its log-probabilities)")
    logprobs: int | None = Field(None, ge=0, le=5, description="log-probabilities of each token and of the "
                                                               "N most probable alternatives")
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One refusal for every wrong shape (the union's own errors name its members: "prompt.str")."""
        def token_ids(items):
            return isinstance(items, list) and all(type(item) is int for item in items)

        if isinstance(value, str) or token_ids(value) or (isinstance(value, list) and (
                all(isinstance(item, str) for item in value) or all(token_ids(item) for item in value))):
            return value
        raise PydanticCustomError("invalid_prompt", "must be a string, a list of strings, a list of token ids "
                                                    "(integers) or a list of such lists")

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.suffix:
            raise field_refusal("suffix", "insertion is not supported")
        if self.best_of not in (None, 1):
            raise field_refusal("best_of", "not supported; leave it out")
        if self.max_tokens == 0 and not self.echo:
            raise field_refusal("max_tokens", "0 is only meaningful with echo (scoring the prompt)")
        if self.stream and self.echo and self.logprobs is not None:
            raise field_refusal("stream", "echo with logprobs is answered whole; send stream: false")
        return self


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"message content of type {part.type!r} is not supported; send text")
            parts.append(part.text)
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None
    functions: list | None = None
    tool_choice: str | dict | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.max_tokens == 0:
            raise field_refusal("max_tokens", "must be at least 1")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise field_refusal(name, "tool and function calling are not supported; leave them out")
        if self.tool_choice not in (None, "none", "auto"):
            raise field_refusal("tool_choice", "tool calling is not supported; leave it out (or send \"none\")")
        if self.top_logprobs and not self.logprobs:
            raise field_refusal("top_logprobs", "needs logprobs: true")
        for index, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":  # OpenAI's: only an assistant's may be null
                raise field_refusal("messages", f"messages[{index}]: a {message.role} message needs its content")
            try:
                message.text()
            except ValueError as exc:
                raise field_refusal("messages", str(exc)) from None
        return self


def parse_request(schema: type[_Request], body: Any) -> _Request:
    """The validated request, or RequestRefused naming the first field at fault."""
    if not isinstance(body, dict):
        raise RequestRefused("the request body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        location = ".".join(error_location(error))
        message = error.get("msg", "invalid value").removeprefix("Value error, ")
        if error.get("type") == "missing":
            message = f"{location} is required"
        elif location:
            message = f"{location}: {message}"
        raise RequestRefused(message, param=location or None) from None


# -- prompts and sampling --


def completion_prompts(request: CompletionRequest, tokenizer, vocabulary_size: int) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt, add_special_tokens=True)]
    elif prompt and all(isinstance(item, int) for item in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(item, str) for item in prompt):
        prompts = [tokenizer.encode(item, add_special_tokens=True) for item in prompt]
    else:
        prompts = [list(item) for item in prompt]
    if not prompts or any(not ids for ids in prompts):
        raise RequestRefused("prompt: needs at least one token", param="prompt")
    if any(not 0 <= token < vocabulary_size for ids in prompts for token in ids):
        raise RequestRefused(f"prompt: token ids must lie in [0, {vocabulary_size})", param="prompt")
    return prompts


def chat_prompt(request: ChatRequest, tokenizer) -> list[int]:
    messages = [{"role": message.role, "content": message.text()} for message in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 (a template's raise_exception, or no template)
        raise RequestRefused(f"messages: the model's chat template refused them ({exc})", param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise RequestRefused("messages: the rendered prompt is empty", param="messages")
    return ids


@dataclass
class Plan:
    """What one request will run: the prompts, how to sample, and how to answer."""

    chat: bool
    prompts: list
    max_new_tokens: int  # 0: score the prompt only (echo)
    temperature: float
    top_p: float  # 0: the most probable token only
    stop_ids: tuple
    stop_strings: tuple
    seed: int | None
    top_k: int = 0  # 0: no limit
    echo: bool = False
    logprobs: int | None = None  # completions: N alternatives; chat: top_logprobs (with logprobs on)
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def plan_request(request: _Request, tokenizer, maximum_context: int, vocabulary_size: int,
                 default_chat_tokens: int) -> Plan:
    chat = isinstance(request, ChatRequest)
    prompts = [chat_prompt(request, tokenizer)] if chat else completion_prompts(request, tokenizer, vocabulary_size)
    longest = max(len(ids) for ids in prompts)
    if longest >= maximum_context:
        raise RequestRefused(f"the prompt has {longest} tokens; the model's context is {maximum_context}",
                             param="messages" if chat else "prompt", code="context_length_exceeded")
    if chat:
        wanted = request.max_completion_tokens or request.max_tokens or default_chat_tokens
    else:
        wanted = DEFAULT_COMPLETION_TOKENS if request.max_tokens is None else request.max_tokens
    seed = request.seed
    if seed is None and request.temperature > 0:
        seed = secrets.randbelow(2**31)
    logprobs = (request.top_logprobs or 0) if chat and request.logprobs else (None if chat else request.logprobs)
    return Plan(chat=chat, prompts=prompts, max_new_tokens=min(wanted, maximum_context - longest),
                temperature=request.temperature, top_p=request.top_p, top_k=max(request.top_k, 0),
                stop_ids=stop_token_ids(tokenizer, chat), stop_strings=request.stop_strings, seed=seed,
                echo=not chat and request.echo, logprobs=logprobs, include_usage=request.include_usage)


def sampling_arguments(plan: Plan) -> dict:
    """SamplingConfig's arguments; a prompt-only score generates one greedy token that is dropped."""
    if plan.max_new_tokens == 0:
        return {"max_new_tokens": 1, "temperature": 0}
    # top_p 0 (OpenAI's range includes it) is the limit of a shrinking nucleus: the most probable token alone
    top_p, top_k = (1.0, 1) if plan.top_p == 0 else (plan.top_p, plan.top_k)
    return {"max_new_tokens": plan.max_new_tokens, "temperature": plan.temperature, "top_p": top_p, "top_k": top_k,
            "stop_token_ids": plan.stop_ids, "stop_strings": plan.stop_strings}


# -- text --


def completion_tokens(plan: Plan, tokens: list) -> list:
    """The generated tokens that are part of the answer: none when scoring, no trailing stop token."""
    if plan.max_new_tokens == 0:
        return []
    return tokens[:-1] if tokens and tokens[-1] in plan.stop_ids else list(tokens)


def completion_text(plan: Plan, tokenizer, tokens: list) -> str:
    text = tokenizer.decode(completion_tokens(plan, tokens), skip_special_tokens=True)
    cuts = [text.find(stop) for stop in plan.stop_strings if stop in text]
    return text[:min(cuts)] if cuts else text


class TextStream:
    """Text deltas of a completion as its tokens arrive, holding back what might still change:
    an unfinished UTF-8 character, or the start of a stop string."""

    def __init__(self, plan: Plan, tokenizer):
        self.plan, self.tokenizer = plan, tokenizer
        self.tokens: list = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        if self.plan.max_new_tokens == 0:
            return ""
        safe = completion_text(self.plan, self.tokenizer, self.tokens).rstrip("\ufffd")
        hold = max((n for stop in self.plan.stop_strings for n in range(1, len(stop))
                    if safe.endswith(stop[:n])), default=0)
        return self._advance(safe[:len(safe) - hold])

    def finish(self, text: str) -> str:
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.emitted) or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta


# -- response bodies --


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def token_entries(generation, tokens: list, prompt: list | None = None) -> list:
    """(token, logprob, top alternatives) of the answer's tokens; with PROMPT (echo) the prompt's first,
    its first token without a log-probability."""
    entries = []
    if prompt is not None:
        entries.append((prompt[0], None, None))
        for i, token in enumerate(prompt[1:]):
            top = generation.prompt_top_logprobs[i] if generation.prompt_top_logprobs else None
            entries.append((token, generation.prompt_logprobs[i], top))
    for i, token in enumerate(tokens):
        entries.append((token, generation.logprobs[i], generation.top_logprobs[i] if generation.top_logprobs else None))
    return entries


def legacy_logprobs(plan: Plan, tokenizer, entries: list, text_offset: int = 0) -> dict:
    """/v1/completions `logprobs`: tokens, token_logprobs, top_logprobs and text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if plan.logprobs else None, "text_offset": []}
    offset = text_offset
    for token, logprob, top in entries:
        text = _token_text(tokenizer, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["text_offset"].append(offset)
        offset += len(text)
        if plan.logprobs:
            out["top_logprobs"].append(None if top is None else
                                       {_token_text(tokenizer, t): lp for t, lp in top[:plan.logprobs]})
    return out


def chat_logprobs(plan: Plan, tokenizer, entries: list) -> dict:
    """/v1/chat/completions `logprobs`: {content: [{token, logprob, bytes, top_logprobs}]}."""
    def item(token, logprob):
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**item(token, logprob), "top_logprobs": [item(t, lp) for t, lp in (top or [])[:plan.logprobs]]}
               for token, logprob, top in entries]
    return {"content": content, "refusal": None}


def finish_reason(plan: Plan, generation) -> str:
    return "length" if plan.max_new_tokens == 0 else generation.finish_reason


def usage(plan: Plan, generations: list) -> dict:
    prompt = sum(len(ids) for ids in plan.prompts)
    completion = sum(len(g.tokens) for g in generations) if plan.max_new_tokens else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _envelope(plan: Plan, model: str, chunk: bool = False) -> dict:
    if plan.chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": f"chatcmpl-{plan.id}", "object": kind, "created": plan.created, "model": model,
                "system_fingerprint": None}
    return {"id": f"cmpl-{plan.id}", "object": "text_completion", "created": plan.created, "model": model,
            "system_fingerprint": None}


def response_body(plan: Plan, model: str, tokenizer, generations: list) -> dict:
    """The whole answer of a request that did not stream."""
    choices = []
    for index, (prompt, generation) in enumerate(zip(plan.prompts, generations)):
        tokens = completion_tokens(plan, generation.tokens)
        text = completion_text(plan, tokenizer, generation.tokens)
        if plan.chat:
            logprobs = (chat_logprobs(plan, tokenizer, token_entries(generation, tokens))
                        if plan.logprobs is not None else None)
            choices.append({"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                            "logprobs": logprobs, "finish_reason": finish_reason(plan, generation)})
        else:
            prefix = tokenizer.decode(prompt) if plan.echo else ""
            entries = token_entries(generation, tokens, prompt if plan.echo else None)
            logprobs = legacy_logprobs(plan, tokenizer, entries) if plan.logprobs is not None else None
            choices.append({"index": index, "text": prefix + text, "logprobs": logprobs,
                            "finish_reason": finish_reason(plan, generation)})
    return {**_envelope(plan, model), "choices": choices, "usage": usage(plan, generations),
            "kiln": {"seed": plan.seed}}


def chunk_body(plan: Plan, model: str, index: int, text: str | None = None, finish: str | None = None,
               logprobs: dict | None = None, role: bool = False) -> dict:
    """One server-sent event of a streamed answer."""
    if plan.chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return {**_envelope(plan, model, chunk=True), "choices": [choice], "kiln": {"seed": plan.seed}}


def usage_chunk(plan: Plan, model: str, generations: list) -> dict:
    return {**_envelope(plan, model, chunk=True), "choices": [], "usage": usage(plan, generations)}
