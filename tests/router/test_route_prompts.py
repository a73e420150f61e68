"""The router tokenizes a prompt as the engine behind it does: the same ids for a completion's text,
texts and token ids, and for a chat rendered by the model's template; the plan's predictor reads them."""

import pytest

from locus.engine.checkpoint.tokenizer import load_tokenizer
from locus.errors import LocusError
from locus.router.prompts import MINI, BadPrompt, PromptTokenizer, tokenizer_for


@pytest.fixture(scope="module")
def both():
    return PromptTokenizer.load(MINI), load_tokenizer(MINI, 4096)


def test_completion_prompts_are_the_engine_s(both):
    router, engine = both
    for special in (True, False):
        assert router.completion_prompts("def f(x):\n    return x", special) == [engine.encode("def f(x):\n    return x",
                                                                                              add_special_tokens=special)]
    assert router.completion_prompts(["Hola", "Ciao"]) == [engine.encode("Hola"), engine.encode("Ciao")]
    assert router.completion_prompts([5, 6, 7]) == [[5, 6, 7]]
    assert router.completion_prompts([[5], [6, 7]]) == [[5], [6, 7]]
    for bad in (None, [], [1, "a"], {"a": 1}, [[]]):
        with pytest.raises(BadPrompt, match="the prompt must be"):
            router.completion_prompts(bad)


def test_a_chat_is_rendered_and_tokenized_as_the_engine_does(both):
    router, engine = both
    messages = [{"role": "system", "content": "Be brief.", "name": None},
                {"role": "user", "content": [{"type": "text", "text": "Wie geht's?"}]}]
    for generation in (True, False):
        want = engine.encode(engine.apply_chat_template([{k: v for k, v in m.items() if v is not None}
                                                         for m in messages], generation), add_special_tokens=False)
        assert router.chat_prompt(messages, generation, None) == want
    with pytest.raises(BadPrompt, match="messages must be"):
        router.chat_prompt([], True)
    with pytest.raises(BadPrompt, match="add_special_tokens must be true or false"):
        router.chat_prompt(messages, True, "yes")


def test_where_the_tokenizer_comes_from(tmp_path):
    assert tokenizer_for("mini", None) == MINI and tokenizer_for("mini", str(tmp_path)) == tmp_path
    assert tokenizer_for(str(MINI), None) == MINI
    with pytest.raises(LocusError, match="the plan's model 'llama4-maverick' has no tokenizer here: give --tokenizer"):
        tokenizer_for("llama4-maverick", None)
    with pytest.raises(LocusError, match="no tokenizer.json there"):
        PromptTokenizer.load(tmp_path)
