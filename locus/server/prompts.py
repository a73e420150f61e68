"""Request text -> prompt token ids, without stalling the event loop.

Tokenizing (and rendering a chat template) is CPU work proportional to the text: done on the event
loop, a multi-megabyte prompt would stall every other stream for as long as it takes. So:
- a text that cannot fit the context whatever its tokens (more than `max_model_len` tokens' worth of
  characters at the tokenizer's longest token) is refused at once, untokenized;
- a large text is tokenized in a worker thread; small ones (the common case) stay inline, where a
  thread hop would cost more than the work.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, TypeVar

from pydantic import BaseModel

from locus.engine.sampling.sampler import InvalidParameter
from locus.engine.checkpoint.tokenizer import Tokenizer

OFF_LOOP_CHARS = 32 * 1024  # texts above this many characters are tokenized in a worker thread
_SCALARS = frozenset({int, float, bool, type(None)})  # JSON values that hold no text

T = TypeVar("T")


def text_chars(value: Any) -> int:
    """Characters of text in a prompt or a messages list (any nesting of str, list, dict). Iterative:
    a client's nesting depth must not reach Python's recursion limit (a 500 where a 400 belongs)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(child for child in item if type(child) not in _SCALARS)
    return total


def check_text_size(chars: int, tokenizer: Tokenizer, max_model_len: int, param: str) -> None:
    """Refuse a text that has more than max_model_len tokens whatever its tokenization."""
    at_least = -(-chars // max(1, tokenizer.max_token_chars))
    if at_least > max_model_len:
        raise InvalidParameter(param, f"the {param} has {chars} characters, so at least {at_least} tokens; "
                                      f"this model's context limit is {max_model_len} tokens")


async def off_loop_if_large(chars: int, work: Callable[[], T]) -> T:
    """Run `work` inline for small inputs, in a worker thread for large ones."""
    if chars <= OFF_LOOP_CHARS:
        return work()
    return await asyncio.to_thread(work)


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """Where a lone UTF-16 surrogate (JSON "\\ud800" with no pair) sits in a parsed body (a pydantic
    model, or plain dicts and lists), or None.
    Such a string is not Unicode text: it cannot be tokenized, nor written back as UTF-8. Iterative,
    depth-first in document order, for the same reason as text_chars."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if item.isascii():
                continue
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
            continue
        if isinstance(item, dict):
            children = list(item.items())
        elif isinstance(item, BaseModel):  # its fields (and extras) as they are: no model_dump per request
            children = list(item.__dict__.items()) + list((item.model_extra or {}).items())
        elif isinstance(item, (list, tuple)):
            children = list(enumerate(item))
        else:
            continue
        for key, child in reversed(children):
            # token ids and other scalars hold no text: a 100k-id prompt costs no path strings
            if type(child) not in _SCALARS:
                stack.append((child, _step(where, key)))
            if isinstance(key, str) and not key.isascii() and not _encodable(key):
                # a key is text too (checked before its value); its path shows the surrogate escaped
                stack.append((key, _step(where, key.encode("utf-8", "backslashreplace").decode("utf-8"))))
    return None


def _step(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
