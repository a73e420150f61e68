"""Request fields Locus knows but does not implement, and fields it does not know: both refused.

A field is honoured, or refused with a 400 that names it, never accepted and dropped (a client that
asks for beam search, a token whitelist or tool calls must learn it did not get them). A field of
OpenAI's or vLLM's protocol that Locus does not implement is still declared on the request model,
so the OpenAPI document lists it, with the only values it takes: those that ask for nothing (its
default, `null`, an empty list). Any other top-level field is refused as unknown, as OpenAI does.
docs/serving.md ("Request fields") lists every field and what happens to it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from locus.engine.sampling.sampler import InvalidParameter


ABSENT = (None,)
FALSE = (None, False)
EMPTY = (None, [])


def refused(why: str, allowed: tuple = ABSENT, default: Any = None) -> Any:
    """A declared field that takes only the values in `allowed`, those that ask for nothing (the
    OpenAPI document lists them; check_refused gives the 400 for any other)."""
    accepted = " or ".join("null" if v is None else json.dumps(v) for v in allowed)
    return Field(default, description=f"Not supported: {why}. Accepted only as {accepted}.",
                 json_schema_extra={"x-locus-refused": why, "enum": list(allowed)})


def _same(value: Any, allowed: Any) -> bool:
    """JSON equality: 1 and 1.0 are one number, but false is not 0."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    if isinstance(value, (int, float)) and isinstance(allowed, (int, float)):
        return value == allowed
    return type(value) is type(allowed) and value == allowed


def check_refused(body: BaseModel) -> None:
    """A 400 for the first declared-but-unsupported field set to a value that asks for something."""
    for name, info in type(body).model_fields.items():
        extra = info.json_schema_extra
        if not isinstance(extra, dict) or "x-locus-refused" not in extra:
            continue
        value = getattr(body, name)
        if not any(_same(value, allowed) for allowed in extra["enum"]):
            raise InvalidParameter(name, f"{name} is not supported: {extra['x-locus-refused']}")


def check_unknown(body: BaseModel) -> None:
    """A 400 for a top-level field neither OpenAI's nor vLLM's protocol has (OpenAI refuses them too)."""
    extra = body.model_extra
    if extra:
        name = next(iter(extra))
        raise InvalidParameter(name, f"unknown field {name!r}: this server does not take it (docs/serving.md, "
                                     "\"Request fields\", lists the fields it does)")
