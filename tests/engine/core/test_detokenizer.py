"""IncrementalDetokenizer: characters split over tokens, stop strings over several tokens, flush, and
HF tokenizers (byte-level BPE, Metaspace) whose deltas must add up to the full decode."""

from __future__ import annotations

import pytest

from locus.engine.core.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_length
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.checkpoint.tokenizer import ByteTokenizer

BYTES = ByteTokenizer(512)
PROMPT = BYTES.encode("Q: hi\nA:")


def feed(detok, ids):
    steps = [detok.add(t) for t in ids]
    return [s.text_delta for s in steps], [s.stop_string for s in steps]


def byte_ids(text):
    return list(text.encode("utf-8"))


def test_a_character_split_over_three_byte_tokens_is_emitted_once_complete():
    detok = IncrementalDetokenizer(BYTES, PROMPT, SamplingParams())
    deltas, _ = feed(detok, byte_ids("a数b"))
    assert deltas == ["a", "", "", "数", "b"]
    assert "\ufffd" not in "".join(deltas) and detok.text == "a数b"


def test_flush_emits_an_incomplete_tail_at_the_end():
    detok = IncrementalDetokenizer(BYTES, PROMPT, SamplingParams())
    deltas, _ = feed(detok, byte_ids("ok") + byte_ids("数")[:2])
    assert "".join(deltas) == "ok"
    assert detok.flush() == "\ufffd"
    assert detok.text == "ok\ufffd"


def test_a_stop_string_over_several_tokens_is_never_emitted_and_cuts_the_text():
    detok = IncrementalDetokenizer(BYTES, PROMPT, SamplingParams(stop=("END",)))
    deltas, stops = feed(detok, byte_ids("abcEND"))
    assert deltas == ["a", "b", "c", "", "", ""]
    assert stops == [None] * 5 + ["END"]
    assert detok.text == "abc" and detok.stop_string == "END"
    assert detok.add(ord("x")).text_delta == "" and detok.flush() == ""  # stopped: nothing more


def test_a_false_start_of_a_stop_string_is_released_when_it_breaks_off():
    detok = IncrementalDetokenizer(BYTES, PROMPT, SamplingParams(stop=("END",)))
    deltas, stops = feed(detok, byte_ids("xENy"))
    assert deltas == ["x", "", "", "ENy"] and stops == [None] * 4
    deltas, _ = feed(detok, byte_ids("zE"))
    assert deltas == ["z", ""]
    assert detok.flush() == "E"
    assert detok.text == "xENyzE"


def test_include_stop_str_in_output_keeps_the_stop_and_drops_what_follows():
    detok = IncrementalDetokenizer(BYTES, PROMPT, SamplingParams(stop=("\n\n", "##"), include_stop_str_in_output=True))
    deltas, stops = feed(detok, byte_ids("one\n") + BYTES.encode("\n\nmore", add_special_tokens=False))
    assert detok.text == "one\n\n" and detok.stop_string == "\n\n"
    assert "".join(deltas) == "one\n\n" and stops[:4] == [None] * 4 and stops[4] == "\n\n"


@pytest.mark.parametrize("stop, step, text", [("oph", 2, "hello st"), ("ell", 0, "h"), ("here", 2, "hello stop")])
def test_a_stop_string_inside_or_across_multi_character_tokens_is_found(stop, step, text):
    tok = _word_level_tokenizer()
    ids = [tok.token_to_id(w) for w in ["▁hello", "▁stop", "here", "▁world"]]
    detok = IncrementalDetokenizer(_Decoder(tok), [], SamplingParams(stop=(stop,)))
    deltas, stops = feed(detok, ids)
    assert stops[step] == stop and detok.text == text == "".join(deltas)


def test_special_tokens_are_skipped_or_kept_per_params():
    ids = byte_ids("hi") + [BYTES.EOS]
    skipping = IncrementalDetokenizer(BYTES, PROMPT, SamplingParams())
    feed(skipping, ids)
    keeping = IncrementalDetokenizer(BYTES, PROMPT, SamplingParams(skip_special_tokens=False))
    feed(keeping, ids)
    assert skipping.text + skipping.flush() == "hi"
    assert keeping.text + keeping.flush() == "hi<|eot|>"


def test_stop_helpers():
    assert find_stop("xabcd", ("abcd", "bc"), 0) == (2, "bc")  # the one completed first wins
    assert find_stop("xabcd", ("zz",), 0) is None
    assert find_stop("abab", ("ab",), 1) == (2, "ab")
    assert partial_stop_length("hello wor", ("world", "lo w")) == 3
    assert partial_stop_length("hello", ("xyz",)) == 0
    assert partial_stop_length("ab", ("abc",)) == 2


# ---------------------------------------------------------------- HF tokenizers

class _Decoder:
    """The slice of locus's HFTokenizer the detokenizer uses, over an in-memory tokenizers.Tokenizer."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eot|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["hello world, how are you?", "the quick brown fox", "数字 and 字"] * 10, trainer)
    return tok


def _word_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<|eot|>", "▁hello", "▁world", "▁how", "▁are", "▁you", "▁stop", "here", "▁!"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<|eot|>"])
    return tok


@pytest.mark.parametrize("text", ["hello world, 数字 and 字 how are you? 😀 ü", "数数数 the quick😀brown fox"])
def test_byte_level_bpe_deltas_add_up_to_the_full_decode(text):
    tok = _byte_level_bpe()
    prompt = tok.encode("the quick").ids
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the test really splits characters
    detok = IncrementalDetokenizer(_Decoder(tok), prompt, SamplingParams())
    deltas, _ = feed(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text


def test_byte_level_bpe_stop_string_across_tokens():
    tok = _byte_level_bpe()
    ids = tok.encode("hello world, how are you?").ids
    detok = IncrementalDetokenizer(_Decoder(tok), [], SamplingParams(stop=("ld, h",)))
    deltas, stops = feed(detok, ids)
    assert detok.stop_string == "ld, h" and detok.text == "hello wor"
    assert "".join(deltas) == "hello wor" and stops.count("ld, h") == 1


def test_metaspace_deltas_continue_the_prompt():
    tok = _word_level_tokenizer()
    prompt = tok.encode("hello world").ids
    ids = tok.encode("how are you !").ids
    detok = IncrementalDetokenizer(_Decoder(tok), prompt, SamplingParams())
    deltas, _ = feed(detok, ids)
    text = "".join(deltas) + detok.flush()
    # the continuation keeps the space a standalone decode of the output would drop
    assert text == tok.decode(prompt + ids)[len(tok.decode(prompt)):] == " how are you !"
    assert deltas[0] == " how"


# ---------------------------------------------------------------- streaming stop-string matching (issue 41)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


class _Pieces:
    """A tokenizer whose token i decodes to pieces[i] whatever its neighbours (so deltas are exact)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def reference_deltas(pieces: list[str], stops: tuple[str, ...], include: bool) -> tuple[list[str], str | None, str]:
    """The detokenizer's contract, computed the direct way: after each token, search the whole decoded
    text for a stop string and hold back its longest suffix that is a proper prefix of one."""
    decoded, text, deltas = "", "", []
    for piece in pieces:
        decoded += piece
        match = find_stop(decoded, stops, start=len(text))
        if match is not None:
            at, stop = match
            deltas.append(decoded[len(text):at + len(stop) if include else at])
            return deltas, stop, ""
        safe = len(decoded) - partial_stop_length(decoded, stops)
        deltas.append(decoded[len(text):max(safe, len(text))])
        text += deltas[-1]
    return deltas, None, decoded[len(text):]


ALPHABET = st.text(alphabet="ab\n", min_size=1, max_size=4)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(pieces=st.lists(ALPHABET, max_size=25), stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=7),
                                                                 min_size=1, max_size=4),
       include=st.booleans())
def test_the_streaming_scanner_keeps_the_detokenizers_contract(pieces, stops, include):
    stops = tuple(stops)
    detok = IncrementalDetokenizer(_Pieces(pieces), [], SamplingParams(stop=stops, include_stop_str_in_output=include))
    deltas, found = feed(detok, range(len(pieces)))
    want, want_stop, held = reference_deltas(pieces, stops, include)
    assert deltas[:len(want)] == want and all(d == "" for d in deltas[len(want):])
    assert detok.stop_string == want_stop and [s for s in found if s] == ([want_stop] if want_stop else [])
    assert detok.flush() == held and detok.text == "".join(want) + held


class _CountingStr(str):
    """A stop string that counts how often the detokenizer reads it (an index or a slice)."""

    reads = 0

    def __getitem__(self, key):
        _CountingStr.reads += 1
        return str.__getitem__(self, key)


def test_stop_string_work_is_linear_in_the_output():
    """Issue 41, finding 7: holding back a possible stop-string prefix re-tried every prefix length at
    every token, O(stop length^2) per token (193 ms a token at 100k characters of output). Now each
    output character advances each stop string's automaton once: the reads of the stop strings are
    O(stop length) to build the tables plus O(1) per token, not O(stop length) per token."""
    length, tokens = 500, 300
    stops = tuple(_CountingStr(c * length) for c in "bcde")
    _CountingStr.reads = 0
    detok = IncrementalDetokenizer(BYTES, [], SamplingParams(stop=stops))
    for _ in range(tokens):
        detok.add(ord("a"))
    assert detok.text == "a" * tokens
    assert _CountingStr.reads <= 4 * (3 * length + 2 * tokens), _CountingStr.reads  # old: ~4 x 500 x 300 = 600k
