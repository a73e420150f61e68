"""`locus train`: train the small Llama-4-style MoE on a corpus built from installed packages."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train a small Llama-4-style MoE on text from installed packages (CPU, plain PyTorch)",
        description="Builds a domain-tagged corpus from installed Debian packages (fortunes in several languages, "
                    "the Python standard library, C headers) and generated arithmetic, trains a byte-level BPE and a "
                    "Llama-4-style MoE, and writes a HuggingFace-format checkpoint to OUT/model (bfloat16, with "
                    "tokenizer, chat template and model card). Checkpoints every --checkpoint-minutes; --resume "
                    "continues from OUT/state.pt.")
    p.add_argument("--out", required=True, help="run directory (corpus, tokenizer, state.pt, log.jsonl, model/)")
    p.add_argument("--corpus", default=None, help="an existing corpus directory (default: OUT/corpus, built if missing)")
    p.add_argument("--install-packages", action="store_true", help="apt-get install the corpus packages that are missing")
    p.add_argument("--size", default=None, choices=["mini", "smoke"], help="model shape (default mini)")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary incl. specials (default 4096)")
    p.add_argument("--seq-len", type=int, default=None, help="training window in tokens (default 256)")
    p.add_argument("--batch-size", type=int, default=None, help="windows a step (default 16)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3)")
    p.add_argument("--aux-coef", type=float, default=None, help="load-balancing loss weight (default 0.01)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many steps (in total, when resuming); default for --size mini: 1325, the "
                        "shipped model's, so a run reproduces it on any machine that gets there within --max-minutes; "
                        "0: no step budget (train until --max-minutes)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop after this much training time (in total)")
    p.add_argument("--checkpoint-minutes", type=float, default=None, help="checkpoint this often (default 5; 0 = only at the end)")
    p.add_argument("--checkpoint-steps", type=int, default=None, help="also checkpoint every N steps")
    p.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens per domain at checkpoints (default 4096)")
    p.add_argument("--final-eval-tokens", type=int, default=None, help="held-out tokens per domain at the end (default 32768)")
    p.add_argument("--max-bytes-per-domain", type=int, default=None, help="corpus cap per domain (default 3000000)")
    p.add_argument("--log-every", type=int, default=None, help="a progress line every N steps (default 10)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resume", action="store_true", help="continue the run in OUT from its state.pt")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from locus.training.train import parse_args, train

    report = train(parse_args(args), log=lambda line: print(line, flush=True))
    print(f"wrote {args.out}/model (held-out loss: "
          + ", ".join(f"{d} {v:.3f}" for d, v in report["heldout_loss"].items()) + ")")
    return 0
