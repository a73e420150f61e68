"""Structured outputs in the engine: the grammar mask forces valid output from a random-weight model,
with the byte tokenizer and a byte-level BPE tokenizer.json; constrained and free rows share a step
without the free rows noticing; a spec that does not compile is refused at admission."""

from __future__ import annotations

import json
import re

import pytest

from locus.engine.core.engine_core import EngineConfig
from locus.engine.frontend.llm import LLM
from locus.engine.checkpoint.presets import build_preset
from locus.engine.sampling.sampler import InvalidParameter, SamplingParams
from locus.engine.sampling.grammar import StructuredOutput
from locus.engine.checkpoint.tokenizer import ByteTokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "ok", "count"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "ok": {"type": "boolean"},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999}}}


def valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"answer", "ok", "count"} and value["answer"] in ("yes", "no", "maybe")
            and isinstance(value["ok"], bool) and isinstance(value["count"], int) and 0 <= value["count"] <= 999)


@pytest.fixture(scope="module")
def llm():
    return LLM.from_model(build_preset("tiny"), ByteTokenizer(), EngineConfig(block_size=8, num_kv_blocks=512))


def test_a_json_schema_forces_valid_json_from_random_weights(llm):
    so = StructuredOutput("json", json.dumps(SCHEMA))
    outs = llm.generate(["hello", "tell me", "x"], SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=80, structured=so))
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 6 and all(valid(t) for t in texts), texts
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    again = llm.generate(["hello", "tell me", "x"], SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=80, structured=so))
    assert [c.text for o in again for c in o.outputs] == texts  # seeds still reproduce


def test_json_object_regex_choice_and_grammar(llm):
    def one(so, **kw):
        params = SamplingParams(temperature=kw.pop("temperature", 0.9), seed=1, max_tokens=kw.pop("max_tokens", 40), structured=so)
        return llm.generate(["prompt"], params)[0].outputs[0]

    assert re.fullmatch(r"[a-c]{3}-\d\d", one(StructuredOutput("regex", r"[a-c]{3}-\d\d")).text)
    assert one(StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma"]))).text in ("alpha", "beta", "gamma")
    assert one(StructuredOutput("grammar", 'root ::= "(" [0-9]+ ")"'), max_tokens=8).text.startswith("(")
    out = one(StructuredOutput("json_object"), temperature=0, max_tokens=200)
    assert out.text.lstrip().startswith("{")  # greedy random weights may not close it in 200 tokens
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_free_rows_in_a_constrained_batch_sample_what_they_sample_alone(llm):
    free = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["free row"], free)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0.8, seed=4, max_tokens=80, structured=StructuredOutput("json", json.dumps(SCHEMA)))
    mixed = llm.generate(["free row", "constrained"], [free, constrained])
    assert mixed[0].outputs[0].token_ids == alone
    assert valid(mixed[1].outputs[0].text)


@pytest.mark.parametrize("so, needle", [
    (StructuredOutput("json", "{not json"), "Failed to parse JSON"),
    (StructuredOutput("regex", "([a-z"), "regex"),
    (StructuredOutput("choice", "[]"), "non-empty"),
    (StructuredOutput("grammar", "root ::= undefined_rule"), "undefined_rule"),
])
def test_a_spec_that_does_not_compile_is_refused_at_admission(llm, so, needle):
    with pytest.raises(InvalidParameter, match=re.escape(needle)) as info:
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured=so))
    assert info.value.param == "response_format" and "does not compile" in str(info.value)
    assert "bad" not in llm.engine.requests


def test_a_byte_level_bpe_tokenizer_is_constrained_too(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from locus.engine.checkpoint.tokenizer import load_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the answer is yes", "count: 12345", '{"ok": true}', "no maybe yes"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    model = build_preset("tiny")  # vocab 261 < 320 ids: use a model whose logits cover the tokenizer
    assert model.config.vocab_size < tok.get_vocab_size()
    from dataclasses import replace

    from locus.engine.model.model import Llama4ForCausalLM
    from locus.engine.checkpoint.presets import init_random

    config = replace(model.config, vocab_size=tok.get_vocab_size())
    model = Llama4ForCausalLM(config, "torch")
    init_random(model, 0)
    hf = load_tokenizer(tmp_path, config.vocab_size)
    llm = LLM.from_model(model.eval(), hf, EngineConfig(block_size=8, num_kv_blocks=256))
    so = StructuredOutput("json", json.dumps(SCHEMA))
    outs = llm.generate(["the answer", "count"], SamplingParams(temperature=1.0, seed=2, max_tokens=60, structured=so))
    assert all(valid(o.outputs[0].text) for o in outs), [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("so", [
    StructuredOutput("regex", "[^\\x00-\\U0010FFFF]", "guided_regex"),  # matches nothing
    StructuredOutput("grammar", 'root ::= root "a"', "guided_grammar"),  # no finite string
    StructuredOutput("json", json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                         "$ref": "#/$defs/a"}), "guided_json"),  # refers only to itself
])
def test_a_constraint_no_output_meets_is_refused_at_admission(llm, so):
    """Each of these compiled, then masked every token and killed the engine (issue 30, finding 1)."""
    with pytest.raises(InvalidParameter, match="accepts no output") as info:
        llm.engine.add_request("nothing", [1, 2, 3], SamplingParams(structured=so))
    assert info.value.param == so.param and "nothing" not in llm.engine.requests


def test_a_constraint_that_dead_ends_mid_output_fails_its_request_alone(llm):
    """`a`, then only EOS is allowed, but min_tokens forbids EOS: no token is left for that row. The
    request ends with an error; the engine and a free request in the same steps go on."""
    stuck = SamplingParams(max_tokens=8, min_tokens=5, structured=StructuredOutput("regex", "a", "guided_regex"))
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = llm.engine
    engine.add_request("stuck", [1, 2, 3], stuck)
    engine.add_request("free", [4, 5, 6], free)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["stuck"].error is not None and "allows no token" in str(finals["stuck"].error)
    assert finals["stuck"].outputs[0].finish_reason == "error" and finals["stuck"].outputs[0].token_ids == [ord("a")]
    assert len(finals["free"].outputs[0].token_ids) == 6 and finals["free"].error is None
    engine.add_request("alone", [1, 2, 3], stuck)  # alone in its step: still its own fault, not the engine's
    while engine.has_unfinished():
        engine.step()


STRINGS = {"type": "object", "additionalProperties": False, "required": ["s", "t", "p", "e", "grid"],
           "properties": {"s": {"type": "string", "maxLength": 12}, "t": {"type": "string", "minLength": 3, "maxLength": 16},
                          "p": {"type": "string", "pattern": "^[a-z]{2,5}$"}, "e": {"enum": ["red", "green", 7]},
                          "grid": {"type": "array", "minItems": 1, "maxItems": 3,
                                   "items": {"type": "array", "maxItems": 2, "items": {"type": "integer"}}}}}


def schema_valid(value) -> bool:
    return (set(value) == {"s", "t", "p", "e", "grid"} and isinstance(value["s"], str) and len(value["s"]) <= 12
            and isinstance(value["t"], str) and 3 <= len(value["t"]) <= 16 and re.fullmatch("[a-z]{2,5}", value["p"])
            and value["e"] in ("red", "green", 7) and 1 <= len(value["grid"]) <= 3
            and all(isinstance(row, list) and len(row) <= 2 and all(isinstance(x, int) for x in row) for row in value["grid"]))


@pytest.mark.slow  # n = 32 grammar-constrained sequences of up to 200 tokens
def test_schema_constrained_output_always_parses_and_meets_the_schema(llm):
    """Issue 30, finding 6: under maxLength, xgrammar's string rule let raw control bytes into strings
    (21 of 24 outputs were not JSON). At temperature 1, n = 32: every finished output parses and holds."""
    params = SamplingParams(temperature=1.0, seed=5, n=32, max_tokens=200,
                            structured=StructuredOutput("json", json.dumps(STRINGS)))
    outputs = llm.generate(["any"], params)[0].outputs
    finished = [o for o in outputs if o.finish_reason == "stop"]
    assert len(finished) >= 24
    for o in finished:
        assert schema_valid(json.loads(o.text)), o.text


@pytest.mark.parametrize("schema,named", [
    ({"not": {"type": "string"}}, "not"),
    ({"type": "integer", "multipleOf": 7}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"if": {"type": "string"}, "then": {"minLength": 2}}}}, "if, then"),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "allOf (with more than one schema)"),
])
def test_keywords_the_constraint_cannot_enforce_are_refused_by_name(llm, schema, named):
    with pytest.raises(InvalidParameter, match=re.escape(named)):
        llm.engine.add_request("kw", [1, 2], SamplingParams(structured=StructuredOutput("json", json.dumps(schema))))


def test_a_property_named_like_a_keyword_is_fine(llm):
    schema = {"type": "object", "properties": {"not": {"type": "boolean"}, "if": {"type": "integer"}}, "required": ["not"]}
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput("json", json.dumps(schema))))
    assert isinstance(json.loads(out[0].outputs[0].text)["not"], bool)


def test_the_vocabulary_is_read_once_whether_prepared_first_or_on_the_first_compile():
    from locus.engine.sampling.grammar import GrammarCompiler

    tok = ByteTokenizer()
    for prepare_first in (True, False):
        grammars = GrammarCompiler(tok, tok.vocab_size)
        assert not grammars.prepared
        if prepare_first:
            grammars.prepare()
            assert grammars.prepared
        compiler = None
        for spec in ("[0-9]{3}", "[a-z]+"):
            grammars.compile(StructuredOutput("regex", spec, "guided_regex"))
            compiler = compiler or grammars._compiler
            assert grammars._compiler is compiler  # built once, then reused
        grammars.prepare()
        assert grammars._compiler is compiler
