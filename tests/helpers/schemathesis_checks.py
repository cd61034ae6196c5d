"""Schemathesis hooks for the router (``SCHEMATHESIS_HOOKS=tests.helpers.schemathesis_checks``).

A schema cannot say how many tokens a text makes, nor how large a whole body may be: the
router's published document says that a body it accepts may still be refused for exactly
two reasons, a prompt too long for the context (400 with the code
``context_length_exceeded``) and a body over ``limits.max_body_bytes`` (413). A run that
allows 400 and 413 for schema-valid data (ST202's ``expected-statuses``) loads this check,
which fails every other such refusal, so ST202 stays as strict as its default otherwise.
``KVC_FUZZ_MAX_BODY_BYTES``: the router's body limit.
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis

MAX_BODY = int(os.environ.get("KVC_FUZZ_MAX_BODY_BYTES", "0"))


@schemathesis.check
def only_documented_limits_refuse_valid_bodies(ctx: Any, response: Any, case: Any) -> bool | None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    if response.status_code == 400:
        try:
            code = json.loads(response.content)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if code != "context_length_exceeded":
            raise AssertionError("a body the schema accepts was refused with 400: "
                                 f"{response.content[:400]!r}")
    elif response.status_code == 413:
        size = len(response.request.body or b"")
        if size <= MAX_BODY:
            raise AssertionError(f"a body of {size} bytes (limit {MAX_BODY}) was refused "
                                 "with 413")
    return None
