"""Which ``chat_template_kwargs`` a request may set: variables the model's chat template
reads, never a key that replaces the template or steers how it is rendered.

The router renders each chat with the model's template itself (it routes by the tokens the
engine will see), through transformers' ``apply_chat_template(messages, **kwargs)``, whose
own keywords include ``chat_template``: passed through, a tenant's
``chat_template_kwargs.chat_template`` would replace the model's template with their Jinja
and run it in the router. vLLM refuses ``chat_template`` and ``tokenize`` there and drops
keys the template does not read (``vllm.renderers.hf.resolve_chat_template_kwargs``).

The contract here: a request may set exactly the names in :func:`allowed_kwargs`, i.e. the
template's undeclared variables (``jinja2.meta.find_undeclared_variables``, as vLLM finds
them) or, when the operator configures one (``limits.chat_template_kwargs``), that
allow-list; in both cases less :data:`RESERVED`: what the renderer sets itself (messages,
tools, documents, the generation-prompt switches, the special tokens), the globals of
transformers' Jinja environment, and ``apply_chat_template``'s own keywords (the template,
tokenisation, padding, truncation, return types). Values are JSON scalars (the request
model, :mod:`kvcentric.router.api.api_models`, says which); any other key is a 400 naming it.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from typing import Any

# apply_chat_template's keywords (transformers 4.4x to 5.x), what it passes to every
# template (messages, tools, documents, the switches, the special tokens) and the globals
# of its sandboxed Jinja environment: none may come from a request
RESERVED = frozenset({
    "chat_template", "tokenize", "conversation", "messages", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "return_assistant_tokens_mask",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "tokenizer_kwargs", "processor_kwargs",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
    "mask_token", "additional_special_tokens",
    "raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner",
    "namespace", "loop", "self", "caller", "varargs", "kwargs",
})
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def template_variables(template: str | Mapping[str, str] | None) -> frozenset[str]:
    """The undeclared variables of ``template`` (a named set of templates: all of them);
    ``ValueError`` if a template does not parse."""
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox

    if template is None:
        return frozenset()
    sources = list(template.values()) if isinstance(template, Mapping) else [template]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.add_extension(_generation_tag())
    found: set[str] = set()
    for src in sources:
        try:
            found |= jinja2.meta.find_undeclared_variables(env.parse(src))
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the model's chat template does not parse: {exc}") from exc
    return frozenset(found)


def _generation_tag() -> Any:
    """transformers' ``{% generation %}`` block tag, parsed as a plain block (its
    assistant-mask tracking is irrelevant to which variables a template reads)."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return Generation


def reserved_for(tokenizer: Any) -> frozenset[str]:
    """:data:`RESERVED` plus this tokenizer's own: the named parameters of its
    ``apply_chat_template`` and its special-token names (it passes them to the template)."""
    names = set(RESERVED)
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
        names |= {p.name for p in params
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    except (TypeError, ValueError):
        pass
    names |= set(getattr(tokenizer, "special_tokens_map", {}) or {})
    return frozenset(names)


def allowed_kwargs(declared: Iterable[str], allow_list: Iterable[str] | None,
                   reserved: frozenset[str] = RESERVED) -> frozenset[str]:
    """The keys a request may set: ``allow_list`` when configured, else ``declared`` (the
    template's variables); never a reserved name, never one that is not an identifier."""
    names = set(declared if allow_list is None else allow_list)
    return frozenset(n for n in names if n not in reserved and NAME_RE.fullmatch(n))


def check_allow_list(names: Iterable[str]) -> tuple[str, ...]:
    """A configured allow-list, checked: identifiers, none of :data:`RESERVED`
    (``ValueError`` naming the offender)."""
    out = []
    for name in names:
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise ValueError(f"limits.chat_template_kwargs: {name!r} is not an identifier")
        if name in RESERVED:
            raise ValueError(f"limits.chat_template_kwargs may not name {name!r}: it would "
                             "let a request replace the template or steer its rendering")
        out.append(name)
    return tuple(dict.fromkeys(out))
