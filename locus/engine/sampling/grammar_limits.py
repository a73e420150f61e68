"""What an output constraint may cost, and where it is compiled.

Compiling a grammar is CPU and memory proportional to the spec, and some specs explode
(docs/serving.md, "Grammar budgets", has the measured cases). So, before xgrammar sees it:
- the spec's size is bounded (`max_bytes`), and a JSON schema's nesting (`max_depth`), a choice list's
  length (`max_choices`); the keywords xgrammar would silently ignore are refused by name;
- compiling runs in a small dedicated pool, off the event loop and off the engine's step: one thread
  for small specs, one for large ones with a bounded queue, so a few slow compiles cannot make a
  trivial regex wait behind them, and a flood of them is refused (503) instead of queued forever;
- a compile has `compile_seconds`: the request waiting on it gets a 400 naming the limit when they
  pass; the compile itself cannot be interrupted, so it finishes in its thread and only a bounded cache
  keeps the result (`cache_bytes`, least recently used out first).
Every refusal names the limit and the flag that sets it.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from locus.engine.sampling.params import InvalidParameter
from locus.errors import LocusError

MiB = 1 << 20
SMALL_SPEC_BYTES = 2048  # specs at most this long compile in the small pool

# JSON-schema keywords xgrammar does not enforce (it ignores them silently): refused with a 400 naming
# them, so that a client never believes a constraint holds when it does not.
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "unevaluatedProperties",
                        "unevaluatedItems", "contains", "minContains", "maxContains", "propertyNames", "uniqueItems",
                        "multipleOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 64 * 1024  # --max-grammar-bytes: the spec's text (schema, regex, grammar, choices)
    max_depth: int = 32  # a JSON schema's nesting of subschemas
    max_choices: int = 1024  # guided_choice entries
    compile_seconds: float = 10.0  # --max-grammar-compile-seconds
    cache_bytes: int = 256 * MiB  # --grammar-cache-bytes: compiled grammars kept
    large_queue: int = 4  # large specs waiting for (or in) their compile thread, at most


class GrammarBusy(LocusError):
    """Too many large grammars are compiling: try again shortly (a 503)."""


def check_spec(so, limits: GrammarLimits) -> None:
    """Refuse a spec over the limits, or a JSON schema using what the constraint cannot enforce."""
    size = len(so.spec.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise InvalidParameter(so.param, f"the {so.kind} constraint is {size} bytes; at most {limits.max_bytes} "
                                         "(--max-grammar-bytes)")
    if so.kind == "choice":
        try:
            count = len(json.loads(so.spec))
        except (ValueError, TypeError):
            return  # the compiler names what is wrong with it
        if count > limits.max_choices:
            raise InvalidParameter(so.param, f"{count} choices; at most {limits.max_choices}")
    if so.kind == "json":
        try:
            schema = json.loads(so.spec)
        except (ValueError, RecursionError):
            return  # not JSON (or absurdly deep): the compiler says so, or the depth check below cannot run
        depth, bad = schema_shape(schema)
        if depth > limits.max_depth:
            raise InvalidParameter(so.param, f"the JSON schema nests {depth} levels deep; at most {limits.max_depth}")
        if bad:
            raise InvalidParameter(so.param, f"the JSON schema uses {', '.join(bad)}, which the output constraint "
                                             "cannot enforce; remove it")
        loop = empty_ref_loop(schema)
        if loop:
            raise InvalidParameter(so.param, f"the {so.kind} constraint accepts no output: its $ref chain "
                                             f"{' -> '.join(loop)} never reaches a schema with content")


def schema_shape(schema: Any) -> tuple[int, list[str]]:
    """(nesting depth of subschemas, unsupported keywords used anywhere). Walks only schema positions
    (a property *named* "not" is fine), iteratively: a client's nesting never reaches Python's
    recursion limit. allOf with several schemas counts as unsupported: xgrammar cannot intersect them."""
    found, deepest, stack = set(), 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        deepest = max(deepest, depth)
        found.update(k for k in UNSUPPORTED_KEYWORDS if k in node)
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.add("allOf (with more than one schema)")
        children = []
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children.extend(node[key].values())
        children.extend(node[key] for key in _SCHEMA_VALUES if key in node)
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                children.extend(node[key])
        stack.extend((child, depth + 1) for child in children)
    return deepest, sorted(found)


# Keywords that say nothing about the value: a schema made of these and "$ref" alone only refers on.
_ANNOTATIONS = {"$ref", "title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
                "writeOnly", "$id", "$schema", "$anchor"}


def empty_ref_loop(schema: Any) -> list[str]:
    """The local `$ref` chain that comes back to itself through schemas holding nothing but the
    reference (`a -> b -> a`), as the list of references followed; [] if there is none. No output can
    meet such a schema. Checked here rather than left to xgrammar, whose releases refuse it at
    different stages with different words (a compile error in some, a grammar that admits no first
    token in others)."""
    if not isinstance(schema, dict):
        return []
    starts = [schema]
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            starts.extend(schema[key].values())
    for start in starts:
        node, seen, chain = start, set(), []
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and set(node) <= _ANNOTATIONS:
            ref = node["$ref"]
            chain.append(ref)
            if ref in seen:
                return chain
            seen.add(ref)
            node = _resolve_local(schema, ref)
    return []


def _resolve_local(schema: dict, ref: str) -> Any:
    """The subschema a local JSON pointer (`#/$defs/a`) names; None for a remote or broken one."""
    if ref == "#":
        return schema
    if not ref.startswith("#/"):
        return None
    node: Any = schema
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class CompilePools:
    """One thread for small specs, one for large ones (at most `large_queue` waiting or running)."""

    def __init__(self, limits: GrammarLimits):
        self.limits = limits
        self._small = ThreadPoolExecutor(1, thread_name_prefix="locus-grammar-small")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="locus-grammar-large")
        self._large_open = 0
        self._lock = threading.Lock()

    def submit(self, so, compile: Callable[[Any], Any]) -> Future:
        if len(so.spec) <= SMALL_SPEC_BYTES:
            return self._small.submit(compile, so)
        with self._lock:
            if self._large_open >= self.limits.large_queue:
                raise GrammarBusy(f"{self._large_open} large output constraints are compiling; try again shortly")
            self._large_open += 1
        future = self._large.submit(compile, so)
        future.add_done_callback(self._large_done)
        return future

    def _large_done(self, _future: Future) -> None:
        with self._lock:
            self._large_open -= 1
