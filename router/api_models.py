"""The request bodies the router accepts, as pydantic models built from its config.

One source for two things: the router validates every OpenAI request against these
models (a violation is a 400 naming the field, before any engine is involved), and the
published OpenAPI schema (:mod:`kvcentric.router.openapi`) is generated from them, so a
client generator or a schema-driven fuzzer sees exactly what is enforced.

Bounds come from the config: ``model`` must be the served name, ``max_tokens`` and
``min_tokens`` at most ``limits.max_tokens``, a token-id prompt at most
``limits.max_prompt_tokens`` ids below the tokenizer's vocabulary size. Text (a prompt,
each message) is bounded by the body size, not by a guess of its tokens: how many tokens
a text makes depends on the tokenizer (one token may span many characters), so the
prompt-token limit is checked exactly after tokenizing
(:func:`kvcentric.router.limits.check_prompt`). The schema's own bounds sit well inside
the body limit, so that a body breaking them still fits and gets a 400 naming the field
(not a 413): text at most ``max_body_bytes // 2`` characters, a chat at most
``max_body_bytes // 512`` messages (at least 16, at most ``MAX_MESSAGES``). Fields not
listed (vLLM's other sampling parameters, e.g. ``logprobs``) pass through to the engine,
which validates them.

Rules that keep every schema-valid body servable (:func:`normalize`): ``stream_options``
is dropped when ``stream`` is not true (OpenAI: "only set this when you set stream");
``min_tokens`` above the request's ``max_tokens`` is lowered to it; and with a
``limits.max_tokens``, a request that names no budget gets that one (the engine's own
default is the whole context).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
)

from kvcentric.router.config import LimitsConfig
from kvcentric.router.errors import Refused

MAX_MESSAGES = 4096  # a long agent loop's history


def text_chars(limits: LimitsConfig) -> int:
    """The longest text field (a prompt, a message) the schema accepts."""
    return max(1, limits.max_body_bytes // 2)


def max_messages(limits: LimitsConfig) -> int:
    """The most messages a chat may have."""
    return min(MAX_MESSAGES, max(16, limits.max_body_bytes // 512))


def _integral(value: Any) -> Any:
    """JSON Schema's ``integer`` includes ``2.0``: pass it on as the int it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(ge: int | None = None, le: int | None = None, lt: int | None = None) -> Any:
    """An integer field type with these bounds that accepts ``2.0`` (the validator comes
    after the bounds, so the JSON schema says ``minimum``/``maximum``)."""
    return Annotated[int, Field(ge=ge, le=le, lt=lt), BeforeValidator(_integral)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"]
    function: ToolFunction


def _strict(model_name: str, /, **fields: Any) -> Any:
    """A model of ``fields`` that refuses any other field."""
    return create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)


def message_type(chars: int) -> Any:
    """The chat message union (discriminated by ``role``), text bounded by ``chars``."""
    text = Annotated[str, Field(max_length=chars)]
    content = text | Annotated[list[TextPart], Field(max_length=8)]
    # name and tool_calls may be left out but not null (vLLM refuses null there)
    system = _strict("SystemMessage", role=(Literal["system", "developer"], ...),
                     content=(content, ...), name=(str, None))
    user = _strict("UserMessage", role=(Literal["user"], ...), content=(content, ...),
                   name=(str, None))
    assistant = _strict("AssistantMessage", role=(Literal["assistant"], ...),
                        content=(content | None, None), name=(str, None),
                        tool_calls=(list[ToolCall], None))
    tool = _strict("ToolMessage", role=(Literal["tool"], ...), content=(content, ...),
                   tool_call_id=(str, ...))
    return Annotated[Union[system, user, assistant, tool],  # noqa: UP007 (runtime types)
                     Field(discriminator="role")]


SALT_CHARS = r"^[^@/\\\x00]+$"  # what vLLM accepts in a cache_salt


def _sampling(limits: LimitsConfig, salt_max: int) -> dict[str, Any]:
    """Fields common to both endpoints: ``name -> (type, default)``; ``salt_max``: the
    longest client ``cache_salt`` (less than vLLM's 128 when the router adds a tenant)."""
    top = limits.max_tokens
    tokens = integer(ge=1, le=top) if top else integer(ge=1)
    int_top = integer(ge=0, le=top) if top else integer(ge=0)
    stop_str = Annotated[str, Field(min_length=1, max_length=64)]
    # nullable exactly where vLLM's own request models are (n, ignore_eos, min_tokens and
    # stop are not: an explicit null there is a 400, not a default)
    return {
        "max_tokens": (tokens | None, None),
        "min_tokens": (int_top, None),
        "temperature": (Annotated[float, Field(ge=0, le=2)] | None, None),
        "top_p": (Annotated[float, Field(gt=0, le=1)] | None, None),
        "top_k": (integer(ge=-1) | None, None),  # vLLM: 0 or -1 disable it
        "n": (integer(ge=1, le=4), None),
        "seed": (integer(ge=0, le=2**31 - 1) | None, None),
        "presence_penalty": (Annotated[float, Field(ge=-2, le=2)] | None, None),
        "frequency_penalty": (Annotated[float, Field(ge=-2, le=2)] | None, None),
        "repetition_penalty": (Annotated[float, Field(gt=0, le=2)] | None, None),
        "stop": (stop_str | Annotated[list[stop_str], Field(max_length=4)], None),
        "stream": (bool | None, None),
        "stream_options": (StreamOptions | None, None),
        "ignore_eos": (bool, None),
        "return_token_ids": (bool, None),
        "cache_salt": (Annotated[str, Field(min_length=1, max_length=salt_max,
                                            pattern=SALT_CHARS)] | None, None),
        "user": (Annotated[str, Field(max_length=256)] | None, None),
    }


def completion_model(served: str, limits: LimitsConfig, vocab: int,
                     salt_max: int = 128) -> type[BaseModel]:
    """``POST /v1/completions`` body: ``prompt`` is text or token ids."""
    cap = limits.max_prompt_tokens
    token_id = integer(ge=0, lt=vocab)
    ids = Annotated[list[token_id], Field(min_length=1, max_length=cap)]  # type: ignore[valid-type]
    fields: dict[str, Any] = {
        "model": (Literal[served] | None, None),  # type: ignore[valid-type]
        "prompt": (Annotated[str, Field(min_length=1, max_length=text_chars(limits))]
                   | ids, ...),
        **_sampling(limits, salt_max)}
    return create_model("CompletionRequest", __config__=ConfigDict(extra="allow"), **fields)


def chat_model(served: str, limits: LimitsConfig, salt_max: int = 128) -> type[BaseModel]:
    """``POST /v1/chat/completions`` body: up to :func:`max_messages` messages, each text
    bounded like a prompt (the token limit applies to the rendered chat, after
    tokenizing)."""
    top = limits.max_tokens
    msg = message_type(text_chars(limits))
    most = max_messages(limits)
    fields: dict[str, Any] = {
        "model": (Literal[served] | None, None),  # type: ignore[valid-type]
        "messages": (Annotated[list[msg], Field(min_length=1, max_length=most)], ...),  # type: ignore[valid-type]
        "max_completion_tokens": (integer(ge=1, le=top) | None if top
                                  else integer(ge=1) | None, None),
        **_sampling(limits, salt_max)}
    return create_model("ChatCompletionRequest", __config__=ConfigDict(extra="allow"),
                        **fields)


def normalize(body: dict[str, Any], limits: LimitsConfig) -> None:
    """Apply the rules of the module docstring to a validated ``body`` (in place)."""
    if not body.get("stream"):
        body.pop("stream_options", None)
    cap = body.get("max_tokens") or body.get("max_completion_tokens")
    if cap is None and limits.max_tokens is not None:
        body["max_tokens"] = cap = limits.max_tokens
    if cap is not None and body.get("min_tokens") is not None and body["min_tokens"] > cap:
        body["min_tokens"] = cap


def validate(model: type[BaseModel], body: dict[str, Any]) -> dict[str, Any]:
    """``body`` checked against ``model`` and as the engine should get it (integral floats
    as ints); :class:`Refused` (400) naming the first bad field."""
    try:
        # strict: "8" is not an integer, true is not 1
        return model.model_validate(body, strict=True).model_dump(exclude_unset=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise Refused(400, f"{where}: {err['msg']} ({exc.error_count()} problem(s))") from exc
