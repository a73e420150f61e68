"""Held-out loss of trained checkpoints on the same documents, in nats per byte.

Each `locus train` run trains its own tokenizer, so two runs' held-out losses in nats per *token*
are not comparable (nor are they when the corpus came from another machine's package versions, which
moves documents between files). This scores every checkpoint on one corpus's held-out documents, each
with its own tokenizer, and divides the summed next-token loss by the documents' UTF-8 bytes.

    python bench/mini_heldout.py --corpus RUN/corpus --models mini RUN/model --out results/mini_heldout.json

Documents are taken in corpus order until --bytes-per-domain; each is `bos text eot` as in training;
the stream is scored in windows of --seq-len + 1 tokens stepping by --seq-len (every token but the
first is predicted once, with up to --seq-len tokens of context).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from locus.engine.checkpoint.loader import load
from locus.training.corpus import read_corpus
from locus.training.train import token_losses


def heldout_texts(corpus: str, bytes_per_domain: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    size: dict[str, int] = {}
    for doc in read_corpus(corpus):
        if doc["split"] != "heldout" or size.get(doc["domain"], 0) >= bytes_per_domain:
            continue
        out.setdefault(doc["domain"], []).append(doc["text"])
        size[doc["domain"]] = size.get(doc["domain"], 0) + len(doc["text"].encode("utf-8"))
    return out


def window_batches(model, tok, docs: list[str], seq_len: int, batch_size: int = 8):
    """The documents as one stream `bos text eot ...`, in windows of seq_len + 1 tokens stepping by
    seq_len, yielded as int64 batches [B, S + 1] of equal-length windows (the last may be shorter)."""
    bos, eos = model.config.bos_token_id, model.config.eos_token_ids[0]
    stream = np.array([t for text in docs for t in (bos, *tok.encode(text, add_special_tokens=False), eos)],
                      dtype=np.int64)
    windows = [stream[i:i + seq_len + 1] for i in range(0, len(stream) - 1, seq_len)]
    for length in sorted({len(w) for w in windows}):
        same = [w for w in windows if len(w) == length]
        for i in range(0, len(same), batch_size):
            yield torch.from_numpy(np.stack(same[i:i + batch_size]))


@torch.no_grad()
def nats_per_byte(model_name: str, texts: dict[str, list[str]], seq_len: int, batch_size: int = 8) -> dict[str, float]:
    loaded = load(model_name, dtype="float32", device="cpu", moe_backend="torch")
    model, tok = loaded.model.eval(), loaded.tokenizer
    out = {}
    for domain, docs in texts.items():
        total = sum(token_losses(model, x).sum().item() for x in window_batches(model, tok, docs, seq_len, batch_size))
        out[domain] = total / sum(len(t.encode("utf-8")) for t in docs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="a corpus directory (documents.jsonl), e.g. a `locus train` run's corpus/")
    ap.add_argument("--models", nargs="+", required=True, help="checkpoint directories or shipped names (mini)")
    ap.add_argument("--bytes-per-domain", type=int, default=65536)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    texts = heldout_texts(args.corpus, args.bytes_per_domain)
    if not texts:
        print(f"{args.corpus}: no held-out documents", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    scores = {name: nats_per_byte(name, texts, args.seq_len) for name in args.models}
    first = args.models[0]
    print(f"held-out nats per byte ({args.corpus}, up to {args.bytes_per_domain} bytes a domain)")
    print("| domain | bytes | " + " | ".join(args.models) + " | " +
          " | ".join(f"{m} / {first}" for m in args.models[1:]) + " |")
    print("|---" * (2 + 2 * len(args.models) - 1) + "|")
    for domain in texts:
        nbytes = sum(len(t.encode("utf-8")) for t in texts[domain])
        row = [f"{scores[m][domain]:.4f}" for m in args.models]
        ratio = [f"{scores[m][domain] / scores[first][domain]:.3f}" for m in args.models[1:]]
        print(f"| {domain} | {nbytes} | " + " | ".join(row) + " | " + " | ".join(ratio) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"corpus": args.corpus, "bytes_per_domain": args.bytes_per_domain,
                                              "seq_len": args.seq_len, "models": args.models,
                                              "nats_per_byte": scores}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
