"""The workload of bench/serve.py: prompts (random or from a --dataset file) and the request bodies."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from serve_lib.common import BenchError

WORDS_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


# --- prompts --------------------------------------------------------------------------------------
def make_prompts(args: argparse.Namespace, vocab: int | None, seed: int, count: int) -> list[str | list[int]]:
    """Token-id lists (random, completions), word strings (random, chat) or the file's prompts, cycled."""
    rng = random.Random(seed)
    if args.dataset != "random":
        lines = read_dataset(Path(args.dataset))
        return [lines[i % len(lines)] for i in range(count)]
    if args.endpoint == "chat":  # chat takes text; lengths in tokens are approximate
        return [" ".join(random_word(rng) for _ in range(args.input_len)) for _ in range(count)]
    high = min(vocab or 32000, 32000)  # same id range as bench/offline.py
    return [[rng.randrange(3, high) for _ in range(args.input_len)] for _ in range(count)]


def random_word(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS_ALPHABET) for _ in range(rng.randint(2, 7)))


def read_dataset(path: Path) -> list[str]:
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as exc:
        raise BenchError(f"cannot read --dataset {path}: {exc.strerror or exc}") from None
    if not lines:
        raise BenchError(f"--dataset {path} has no prompts")
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise BenchError(f"--dataset {path}:{number}: expected a JSON object with a \"prompt\" string") from None
        if not isinstance(prompt, str) or not prompt:
            raise BenchError(f"--dataset {path}:{number}: \"prompt\" must be a non-empty string")
        prompts.append(prompt)
    return prompts


def request_body(endpoint: str, model: str, prompt: str | list[int], output_len: int) -> dict:
    body: dict = {"model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def warmup_len(args: argparse.Namespace) -> int:
    return min(args.output_len, 8)
