"""The JSON-schema checks made before xgrammar sees a schema (locus/engine/sampling/grammar_limits.py)."""

import json

import pytest

from locus.engine.sampling.params import InvalidParameter
from locus.engine.sampling.grammar import StructuredOutput
from locus.engine.sampling.grammar_limits import GrammarLimits, check_spec, empty_ref_loop


@pytest.mark.parametrize("schema, loop", [
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     ["#/$defs/b", "#/$defs/a", "#/$defs/b"]),
    ({"$ref": "#"}, ["#", "#"]),
    ({"definitions": {"x": {"$ref": "#/definitions/x", "description": "only a note"}}, "type": "object"},
     ["#/definitions/x", "#/definitions/x"]),
])
def test_a_ref_chain_back_to_itself_with_no_content_is_found(schema, loop):
    assert empty_ref_loop(schema) == loop


@pytest.mark.parametrize("schema", [
    # a tree: recursive, but every level has content, so finite outputs exist
    {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
     "$ref": "#/$defs/node"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}}, "$ref": "#/$defs/a"},
    {"$ref": "https://example.com/remote.json"},
    {"$ref": "#/$defs/missing"},
    {"type": "string"},
    [1, 2],
])
def test_schemas_with_content_or_no_local_loop_pass(schema):
    assert empty_ref_loop(schema) == []


def test_check_spec_refuses_the_loop_by_name_before_any_compile():
    """Refused the same way whatever xgrammar's release says about it (0.2.9 raises at compile time)."""
    spec = json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
    with pytest.raises(InvalidParameter, match=r"accepts no output: its \$ref chain #/\$defs/b -> #/\$defs/a") as info:
        check_spec(StructuredOutput("json", spec, "guided_json"), GrammarLimits())
    assert info.value.param == "guided_json"
