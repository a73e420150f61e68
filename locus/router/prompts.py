"""A request's prompt token ids, as the engine behind the router will tokenize them: the plan's prompt
predictor reads them, and the grouper charges a rank the prompt's length.

The tokenizer is the model's `tokenizer.json` (HF `tokenizers`) and its chat template, rendered by the
same code as the engine's (locus/chat_template.py), with OpenAI's and vLLM's defaults as Locus applies
them: a completion's text gets the special tokens (BOS) unless `add_special_tokens` is false; a chat's
rendered conversation does not unless it is true (the template writes its own); token-id prompts are
taken as they are. A prompt the router cannot read is the client's error (a 400 naming the field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from locus.chat_template import find_chat_template, read_json, render_chat_template
from locus.errors import LocusError

MINI = Path(__file__).resolve().parents[1] / "assets" / "mini"


class BadPrompt(LocusError):
    """A prompt field the router cannot tokenize; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class PromptTokenizer:
    directory: Path
    tokenizer: object  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token: str
    eos_token: str

    @classmethod
    def load(cls, directory: str | Path, chat_template: str | None = None) -> "PromptTokenizer":
        """A model directory holding tokenizer.json (and tokenizer_config.json), or tokenizer.json itself."""
        from tokenizers import Tokenizer

        path = Path(directory)
        if path.is_file():
            path = path.parent
        file = path / "tokenizer.json"
        if not file.is_file():
            raise LocusError(f"--tokenizer {directory}: no tokenizer.json there")
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise LocusError(f"{file}: cannot load tokenizer ({exc})") from None
        cfg = read_json(path / "tokenizer_config.json") or {}
        template = chat_template if chat_template is not None else find_chat_template(path, cfg)
        return cls(path, tok, template, _token_text(cfg.get("bos_token")) or "", _token_text(cfg.get("eos_token")) or "")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def completion_prompts(self, prompt: object, add_special_tokens: object = True) -> list[list[int]]:
        """OpenAI's four prompt forms (a text, texts, token ids, lists of token ids) -> token id lists."""
        special = _flag(add_special_tokens, "add_special_tokens", True)
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt, add_special_tokens=special).ids]
        if not isinstance(prompt, list) or not prompt:
            raise BadPrompt("prompt", "the prompt must be a text, a list of texts, or token ids (lists of them)")
        if all(_int(p) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [e.ids for e in self.tokenizer.encode_batch(prompt, add_special_tokens=special)]
        if all(isinstance(p, list) and p and all(_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
        raise BadPrompt("prompt", "the prompt must be a text, a list of texts, or token ids (lists of them)")

    def chat_prompt(self, messages: object, add_generation_prompt: object = True,
                    add_special_tokens: object = False) -> list[int]:
        """A conversation rendered by the chat template, then tokenized."""
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadPrompt("messages", "messages must be a non-empty list of message objects")
        if self.chat_template is None:
            raise BadPrompt("messages", f"the tokenizer at {self.directory} has no chat template")
        # as the engine sees a message: its fields without the null ones
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            text = render_chat_template(self.chat_template, messages, _flag(add_generation_prompt,
                                                                               "add_generation_prompt", True),
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except LocusError as exc:
            raise BadPrompt("messages", str(exc)) from None
        special = _flag(add_special_tokens, "add_special_tokens", False)
        return self.tokenizer.encode(text, add_special_tokens=special).ids


def tokenizer_for(plan_model: str, given: str | None) -> Path:
    """Where the tokenizer is: --tokenizer, else the plan's model when it is the shipped `mini` or a
    directory holding tokenizer.json."""
    if given:
        return Path(given)
    if plan_model == "mini":
        return MINI
    path = Path(plan_model)
    if (path / "tokenizer.json").is_file():
        return path
    raise LocusError(f"the plan's model {plan_model!r} has no tokenizer here: give --tokenizer DIR (the model's "
                     "directory, with tokenizer.json)")


def model_shape(directory: Path) -> dict | None:
    """The model's config.json next to its tokenizer (vocabulary, MoE layers, experts), None if absent."""
    path = directory / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LocusError(f"{path}: not valid JSON ({exc.msg})") from None


def _flag(value: object, name: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadPrompt(name, f"{name} must be true or false")
    return value


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_text(token: object) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None
