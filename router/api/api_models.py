"""The request bodies the router accepts, as pydantic models built from its bounds.

One source for two things: the router validates every OpenAI request against these
models (a violation is a 400 naming the field, before any engine is involved), and the
published OpenAPI schema (:mod:`kvcentric.router.api.openapi`) is generated from them, so a
client generator or a schema-driven fuzzer sees exactly what is enforced.

Only the fields listed here are accepted (any other field is a 400): each is forwarded to
the engine, so each is held to bounds at least as strict as vLLM's own (its request models
and ``SamplingParams``): ``temperature`` 0..2, ``top_p`` in (0, 1], ``top_k`` >= -1,
``min_p`` 0..1, the penalties, ``n`` 1..``limits.max_n``, ``logprobs`` /
``top_logprobs`` / ``prompt_logprobs`` 0..``limits.max_logprobs`` (vLLM's
``--max-logprobs``; -1, the whole vocabulary, is not accepted), ``priority`` in
``limits.min_priority..max_priority`` (0 by default: a tenant's priority would jump other
tenants' queues on an engine that schedules by priority; vLLM's own bound is any int64),
token ids below the vocabulary, ``max_tokens`` / ``min_tokens`` at most the context (or
``limits.max_tokens``), ``seed`` a 64-bit integer. vLLM's rules that join two fields are
both checked and published (``allOf`` of ``if``/``then``): no ``prompt_logprobs`` on a
streamed request, and ``top_logprobs`` only with ``logprobs: true``. A chat's
``chat_template_kwargs`` takes only the keys :mod:`kvcentric.router.chat_template` allows,
with JSON scalar values. Fields that steer the engine beyond one request
(``kv_transfer_params``, ``vllm_xargs``, ``chat_template``, ``request_id``, prompt
embeddings, structured-output grammars, tools) are not accepted.

Text (a prompt, each message) is bounded by characters: at most ``limits.max_prompt_chars``
and the body limit (a character takes at least one byte of JSON). A text of many escaped
characters can break the body limit first and get its 413 instead of a 400 naming the
field; bounding text by a twelfth of the body (the most bytes one character can take) would
refuse the long prompts a long-context model serves, of more than 349525 characters under
the default 4 MiB body (the Mooncake conversation trace has prompts of 437k characters and
87k tokens, for a 128k context). A chat has at most ``max_body_bytes // 512`` messages (at
least 16, at most ``MAX_MESSAGES``). How many tokens a text makes depends on the tokenizer,
so the prompt's size is checked after rendering and tokenising
(:class:`kvcentric.router.api.limits.Bounds`): that 400 carries the code
``context_length_exceeded`` and is the one refusal of a schema-valid body (the published
document says so in the bodies' descriptions).

Rules that keep every schema-valid body servable (:func:`normalize`): ``stream_options``
is dropped when ``stream`` is not true (OpenAI: "only set this when you set stream");
``min_tokens`` above the request's ``max_tokens`` is lowered to it; and with a
``limits.max_tokens``, a request that names no budget gets that one (the engine's own
default is the whole context).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    model_validator,
)

from kvcentric.router.api.errors import Refused
from kvcentric.router.api.limits import CONTEXT_EXCEEDED, Bounds, too_long

MAX_MESSAGES = 4096  # a long agent loop's history
INT64 = 2**63
SALT_CHARS = r"^[^@/\\\x00]+$"  # what vLLM accepts in a cache_salt
# a request's own Python-regex patterns (JSON Schema semantics: searched, as fuzzers do)
_CONFIG = ConfigDict(extra="forbid", regex_engine="python-re")
_STREAM_IS_TRUE: dict[str, Any] = {"properties": {"stream": {"const": True}},
                                   "required": ["stream"]}
NO_STREAMED_PROMPT_LOGPROBS: Any = {
    "if": _STREAM_IS_TRUE,
    "then": {"properties": {"prompt_logprobs": {"enum": [0, None]}}}}
TOP_LOGPROBS_NEED_LOGPROBS: Any = {
    "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
           "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}}


def text_chars(b: Bounds) -> int:
    """The longest text field (a prompt, a message) the schema accepts."""
    return max(1, min(b.max_prompt_chars, b.max_body_bytes))


def max_messages(b: Bounds) -> int:
    """The most messages a chat may have."""
    return min(MAX_MESSAGES, max(16, b.max_body_bytes // 512))


def _integral(value: Any) -> Any:
    """JSON Schema's ``integer`` includes ``2.0``: pass it on as the int it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(ge: int | None = None, le: int | None = None, lt: int | None = None) -> Any:
    """An integer field type with these bounds that accepts ``2.0`` (the validator comes
    after the bounds, so the JSON schema says ``minimum``/``maximum``)."""
    return Annotated[int, Field(ge=ge, le=le, lt=lt), BeforeValidator(_integral)]


def number(ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """A float field type with these bounds."""
    return Annotated[float, Field(ge=ge, gt=gt, le=le)]


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


def template_kwargs_model(names: frozenset[str]) -> Any:
    """``chat_template_kwargs``: exactly ``names`` (each optional), JSON scalar values.
    Fields are aliased so that no template variable can shadow a pydantic attribute."""
    scalar = Annotated[str, Field(max_length=1024)] | bool | int | float | None
    fields: dict[str, Any] = {f"k{i}": (scalar, Field(None, alias=name))
                              for i, name in enumerate(sorted(names))}
    return create_model("ChatTemplateKwargs", __config__=ConfigDict(extra="forbid"), **fields)


def _sampling(b: Bounds) -> dict[str, Any]:
    """Fields common to both endpoints: ``name -> (type, default)``."""
    stop_str = Annotated[str, Field(min_length=1, max_length=64)]
    token_id = integer(ge=0, lt=b.vocab_size)
    lo, hi = b.priority
    # nullable exactly where vLLM's own request models are (n, ignore_eos, min_tokens, stop,
    # priority and the output switches are not: an explicit null there is a 400)
    return {
        "max_tokens": (integer(ge=1, le=b.max_tokens) | None, None),
        "min_tokens": (integer(ge=0, le=b.max_tokens), None),
        "temperature": (number(ge=0, le=2) | None, None),
        "top_p": (number(gt=0, le=1) | None, None),
        "top_k": (integer(ge=-1, le=2**31 - 1) | None, None),  # vLLM: 0 or -1 disable it
        "min_p": (number(ge=0, le=1) | None, None),
        "n": (integer(ge=1, le=b.max_n), None),
        "seed": (integer(ge=-INT64, le=INT64 - 1) | None, None),
        "presence_penalty": (number(ge=-2, le=2) | None, None),
        "frequency_penalty": (number(ge=-2, le=2) | None, None),
        "repetition_penalty": (number(gt=0, le=2) | None, None),
        "stop": (stop_str | Annotated[list[stop_str], Field(max_length=4)], None),
        "stop_token_ids": (Annotated[list[token_id], Field(max_length=64)]  # type: ignore[valid-type]
                           | None, None),
        "include_stop_str_in_output": (bool, None),
        "skip_special_tokens": (bool, None),
        "spaces_between_special_tokens": (bool, None),
        "stream": (bool | None, None),
        "stream_options": (StreamOptions | None, None),
        "ignore_eos": (bool, None),
        "return_token_ids": (bool | None, None),
        "prompt_logprobs": (integer(ge=0, le=b.max_logprobs) | None, None),
        "priority": (integer(ge=lo, le=hi), None),
        "cache_salt": (Annotated[str, Field(min_length=1, max_length=b.salt_max,
                                            pattern=SALT_CHARS)] | None, None),
        "user": (Annotated[str, Field(max_length=256)] | None, None),
    }


def _context_note(b: Bounds) -> str:
    return (f"The rendered prompt must leave room for an answer: at most "
            f"{b.max_prompt_tokens} tokens and {b.max_prompt_chars} characters (fewer when "
            f"the engines' context is smaller); a longer one is refused with 400 and the "
            f"error code {CONTEXT_EXCEEDED}, the one refusal of a body this schema accepts.")


class _Completion(BaseModel):
    model_config = ConfigDict(**_CONFIG, json_schema_extra={"allOf": [
        NO_STREAMED_PROMPT_LOGPROBS]})

    @model_validator(mode="after")
    def _joined(self) -> _Completion:
        _check_streamed_prompt_logprobs(self)
        return self


class _Chat(BaseModel):
    model_config = ConfigDict(**_CONFIG, json_schema_extra={"allOf": [
        NO_STREAMED_PROMPT_LOGPROBS, TOP_LOGPROBS_NEED_LOGPROBS]})

    @model_validator(mode="after")
    def _joined(self) -> _Chat:
        _check_streamed_prompt_logprobs(self)
        if (getattr(self, "top_logprobs", None) or 0) > 0 and getattr(self, "logprobs",
                                                                       None) is not True:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


def _check_streamed_prompt_logprobs(m: BaseModel) -> None:
    if getattr(m, "stream", None) is True and (getattr(m, "prompt_logprobs", None) or 0) > 0:
        raise ValueError("prompt_logprobs are not available when stream is true")


def completion_model(served: str, b: Bounds) -> type[BaseModel]:
    """``POST /v1/completions`` body: ``prompt`` is text or token ids."""
    token_id = integer(ge=0, lt=b.vocab_size)
    ids = Annotated[list[token_id], Field(min_length=1,  # type: ignore[valid-type]
                                          max_length=b.max_prompt_tokens)]
    fields: dict[str, Any] = {
        "model": (Literal[served] | None, None),  # type: ignore[valid-type]
        "prompt": (Annotated[str, Field(min_length=1, max_length=text_chars(b))] | ids, ...),
        "echo": (bool | None, None),
        "logprobs": (integer(ge=0, le=b.max_logprobs) | None, None),
        "add_special_tokens": (bool, None),
        **_sampling(b)}
    return create_model("CompletionRequest", __base__=_Completion,
                        __doc__=f"An OpenAI completion request. {_context_note(b)}", **fields)


def chat_model(served: str, b: Bounds) -> type[BaseModel]:
    """``POST /v1/chat/completions`` body: up to :func:`max_messages` messages, each text
    bounded like a prompt (the token limit applies to the rendered chat, after
    tokenizing)."""
    msg = message_type(text_chars(b))
    fields: dict[str, Any] = {
        "model": (Literal[served] | None, None),  # type: ignore[valid-type]
        "messages": (Annotated[list[msg], Field(min_length=1,  # type: ignore[valid-type]
                                                max_length=max_messages(b))], ...),
        "max_completion_tokens": (integer(ge=1, le=b.max_tokens) | None, None),
        "logprobs": (bool | None, None),
        "top_logprobs": (integer(ge=0, le=b.max_logprobs) | None, None),
        "add_generation_prompt": (bool, None),
        "add_special_tokens": (bool, None),
        "chat_template_kwargs": (template_kwargs_model(b.template_kwargs) | None, None),
        **_sampling(b)}
    return create_model("ChatCompletionRequest", __base__=_Chat,
                        __doc__=f"An OpenAI chat completion request. {_context_note(b)}",
                        **fields)


def normalize(body: dict[str, Any], b: Bounds) -> None:
    """Apply the rules of the module docstring to a validated ``body`` (in place)."""
    if not body.get("stream"):
        body.pop("stream_options", None)
    cap = body.get("max_completion_tokens") or body.get("max_tokens")
    if cap is None and b.default_max_tokens is not None:
        body["max_tokens"] = cap = b.default_max_tokens
    if cap is not None and body.get("min_tokens") is not None and body["min_tokens"] > cap:
        body["min_tokens"] = cap


# pydantic error types saying "not this branch's type": in a union (text or token ids, a
# value or null) the branch the value was meant for has the error worth reporting
_WRONG_TYPE = frozenset({"string_type", "list_type", "int_type", "float_type", "bool_type",
                         "none_required", "model_type", "dict_type", "model_attributes_type",
                         "int_from_float", "union_tag_invalid"})
# what a pattern-checked field accepts, in words (an error never shows the regex)
_PATTERN_WORDS = {"cache_salt": "must not contain '@', '/', '\\' or a NUL character"}
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _where(loc: tuple[Any, ...]) -> tuple[str, ...]:
    """An error's location as the body names it: union branch tags (``constrained-str``,
    ``list[...]``, ``int``, a message's role) dropped, list indexes kept."""
    out: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out.append(str(part))
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list",
                                                  "none") and not (
                part in _ROLES and i >= 2 and loc[i - 2] == "messages"):
            out.append(part)
    return tuple(out)


def _size(value: Any) -> str:
    """What was sent, briefly: a text's or a list's length, else the value itself."""
    if isinstance(value, str):
        return f"{len(value)} characters"
    if isinstance(value, list):
        return f"{len(value)} items"
    if isinstance(value, dict):
        return f"an object of {len(value)} fields"
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:40] + "..."


def _limit(err: Any) -> Any:
    ctx = err.get("ctx") or {}
    return next((ctx[k] for k in ("max_length", "le", "lt", "ge", "gt", "min_length")
                 if k in ctx), None)


def validate(model: type[BaseModel], body: dict[str, Any], b: Bounds | None = None,
             context: int | None = None) -> dict[str, Any]:
    """``body`` checked against ``model`` and as the engine should get it (integral floats
    as ints); :class:`Refused` (400) naming the first bad field, its limit and the size of
    what was sent (never a pattern). With the bounds ``b`` and the ``context`` the request
    is held to, a prompt (or message) past the schema's length bounds is
    ``context_length_exceeded``, as one past the token count is after tokenising, and a
    token id past the vocabulary says ``invalid token id``."""
    try:
        # strict: "8" is not an integer, true is not 1
        return model.model_validate(body, strict=True).model_dump(exclude_unset=True,
                                                                  by_alias=True)
    except ValidationError as exc:
        errors = exc.errors()
        first = _where(errors[0]["loc"])[:1]
        mine = [e for e in errors if _where(e["loc"])[:1] == first]
        err = next((e for e in mine if e["type"] not in _WRONG_TYPE), mine[0])
        path = _where(err["loc"])
        fields = len({_where(e["loc"])[:1] for e in errors})
        raise _refusal(err, path, b, context, fields) from exc


def _refusal(err: Any, path: tuple[str, ...], b: Bounds | None, context: int | None,
             fields: int) -> Refused:
    """The refusal of ``err`` at ``path`` (``fields``: how many fields failed)."""
    where = ".".join(path) or "body"
    value, kind = err.get("input"), err["type"]
    text_field = bool(path) and (path[0] == "prompt" or path[0] == "messages"
                                 and path[-1] in ("content", "text"))
    if b is not None and kind in ("too_long", "string_too_long") and text_field:
        ctx = context or b.max_model_len
        if isinstance(value, list) and path == ("prompt",):
            b.check_tokens(len(value), ctx)  # raises context_length_exceeded
        elif isinstance(value, str):
            return too_long(ctx, f"(field {where}) contains {len(value)} characters (more "
                                 f"than {_limit(err)}, the most one text may have)")
    if kind in ("less_than", "less_than_equal") and b is not None and len(path) >= 2 \
            and path[0] in ("prompt", "stop_token_ids") and path[-1].isdigit() \
            and isinstance(value, int):
        return Refused(400, f"{where}: invalid token id {value}: the vocabulary has ids 0 "
                            f"to {b.vocab_size - 1}")
    if kind == "string_pattern_mismatch":
        msg = _PATTERN_WORDS.get(path[-1] if path else "", "has characters not accepted here")
    else:
        msg = err["msg"]
    got = "" if kind in ("missing", "extra_forbidden") else f"; got {_size(value)}"
    more = f" (and {fields - 1} more field(s))" if fields > 1 else ""
    return Refused(400, f"{where}: {msg}{got}{more}")
