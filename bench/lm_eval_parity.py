"""EleutherAI's lm-evaluation-harness scoring through Locus: its `local-completions` backend against a
`locus serve` process, beside its transformers backend (`hf`) on the same checkpoint, on two local
tasks written from the model's shipped held-out text (no download):

- `locus_heldout_mc`, multiple choice: a held-out document's first part, and four continuations (its
  own, and three other items' own); `acc` and `acc_norm` from each choice's loglikelihood;
- `locus_heldout_ppl`, perplexity: every held-out document scored whole (`loglikelihood_rolling`);
  `word_perplexity`, `byte_perplexity`, `bits_per_byte`.

    pip install '.[eval]'     # lm-eval 0.4.13 with its API and transformers backends
    python bench/lm_eval_parity.py --model mini --out results/lm_eval_mini.json

lm-eval reads the server's tokenizer as a vLLM server offers it (GET /tokenizer_info, then /tokenize
and /detokenize: its default for local-completions) and scores with `echo` + `logprobs` +
`max_tokens: 1` on token-id prompts, batched. Both backends run the checkpoint in float32. The tasks
(yaml + jsonl) are written next to --out; the table compares each metric, and every request's
loglikelihood, between the two backends.

Both backends must score the same tokens, and lm-eval 0.4.13 tokenizes differently in each:

- its remote tokenizer never adds special tokens (it sends `add_special_tokens: false` to /tokenize
  whatever it is asked), while the transformers backend adds what the tokenizer's post-processor adds
  (mini's: a BOS before every context and continuation it encodes). The hf run is given
  `add_bos_token=False`, so both score the text without a BOS (with it, every loglikelihood of the hf
  run differs: the model sees another first token);
- its remote tokenizer takes the rolling windows' prefix token as `bos_token_id or eos_token_id`, so a
  BOS whose id is 0 (mini's) is replaced by EOS, while the transformers backend uses BOS. The script
  passes the BOS id as `custom_prefix_token_id`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files; nothing to fetch
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from serve_lib.server import free_port, start_server, stop_server, wait_until_ready  # noqa: E402

PROG = "lm_eval_parity"
TASKS = ("locus_heldout_mc", "locus_heldout_ppl")


def model_dir(model: str) -> Path:
    from locus.engine.checkpoint.loader import SHIPPED

    path = SHIPPED.get(model) or Path(model)
    if not (path / "config.json").is_file() or not (path / "heldout_sample.json").is_file():
        sys.exit(f"{PROG}: {model}: needs a checkpoint directory with config.json and heldout_sample.json "
                 "(what `locus train` writes)")
    return path


def heldout_documents(path: Path) -> list[tuple[str, str]]:
    """(domain, text) of the held-out sample `locus train` ships with a model, in file order."""
    sample = json.loads((path / "heldout_sample.json").read_text())
    return [(domain, text) for domain, texts in sample["documents"].items() for text in texts if text.strip()]


def word_cut(text: str, at: int) -> int:
    """The first whitespace at or after `at` (so both parts keep whole words), else len(text)."""
    while at < len(text) and not text[at].isspace():
        at += 1
    return at


def mc_items(docs: list[tuple[str, str]], choices: int = 4, span: int = 48) -> list[dict]:
    """One item per document of 80+ characters: its first half as context, the next ~`span`
    characters (whole words) as the gold continuation, and other items' gold continuations as the
    distractors (items spread over the list, so most come from other documents and domains)."""
    items = []
    for domain, text in docs:
        if len(text) < 80:
            continue
        cut = word_cut(text, len(text) // 2)
        end = word_cut(text, cut + span)
        gold = text[cut:end]
        if cut == 0 or not gold.strip():
            continue
        items.append({"domain": domain, "context": text[:cut], "gold_text": gold})
    n = len(items)
    step = max(1, n // choices)
    for i, item in enumerate(items):
        others = []
        k = 1
        while len(others) < choices - 1:
            other = items[(i + k * step + (k - 1)) % n]["gold_text"]
            if other != item["gold_text"] and other not in others:
                others.append(other)
            k += 1
        gold_at = i % choices
        item["choices"] = others[:gold_at] + [item["gold_text"]] + others[gold_at:]
        item["gold"] = gold_at
    return items


def write_tasks(task_dir: Path, docs: list[tuple[str, str]]) -> dict[str, int]:
    task_dir.mkdir(parents=True, exist_ok=True)
    mc = mc_items(docs)
    with open(task_dir / "mc.jsonl", "w") as f:
        for item in mc:
            f.write(json.dumps({k: item[k] for k in ("domain", "context", "choices", "gold")}, ensure_ascii=False) + "\n")
    with open(task_dir / "ppl.jsonl", "w") as f:
        for domain, text in docs:
            f.write(json.dumps({"domain": domain, "text": text}, ensure_ascii=False) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (task_dir / "locus_heldout_mc.yaml").write_text(
        f"task: locus_heldout_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {task_dir.resolve() / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{gold}}\"\ntarget_delimiter: \"\"\nmetric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    (task_dir / "locus_heldout_ppl.yaml").write_text(
        f"task: locus_heldout_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {task_dir.resolve() / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return {"locus_heldout_mc": len(mc), "locus_heldout_ppl": len(docs)}


def evaluate(model: str, model_args: str, task_dir: Path, batch_size: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), batch_size=batch_size,
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    return {"seconds": time.perf_counter() - start, "results": out["results"], "samples": out["samples"]}


def per_request_scores(samples: dict) -> dict[str, list[float]]:
    """Every loglikelihood each task asked for, in document order (choices in order)."""
    scores = {}
    for task, docs in samples.items():
        values = []
        for doc in sorted(docs, key=lambda d: d["doc_id"]):
            for resp in doc["filtered_resps"]:
                values.append(float(resp[0] if isinstance(resp, (list, tuple)) else resp))
        scores[task] = values
    return scores


def metrics_of(results: dict) -> dict[str, dict[str, float]]:
    return {task: {k.split(",")[0]: v for k, v in values.items() if "," in k and not k.split(",")[0].endswith("_stderr")}
            for task, values in results.items()}


def main() -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mini", help="a shipped model name or a checkpoint directory (default mini)")
    p.add_argument("--dtype", default="float32", help="both backends' dtype (default float32)")
    p.add_argument("--device", default="cpu", help="both backends' device (default cpu)")
    p.add_argument("--batch-size", type=int, default=8, help="requests lm-eval batches (prompts per request)")
    p.add_argument("--out", default="results/lm_eval_mini.json")
    p.add_argument("--task-dir", default=None, help="where the tasks are written (default: next to --out)")
    args = p.parse_args()

    path = model_dir(args.model)
    out = Path(args.out)
    task_dir = Path(args.task_dir) if args.task_dir else out.with_name(out.stem + "_tasks")
    counts = write_tasks(task_dir, heldout_documents(path))
    print(f"tasks in {task_dir}: " + ", ".join(f"{k} ({v} documents)" for k, v in counts.items()))

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server([sys.executable, "-m", "locus.cli", "serve", "--model", str(path), "--dtype", args.dtype,
                           "--device", args.device, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], None, None)
    try:
        with httpx.Client(timeout=60) as client:
            wait_until_ready(client, url, 300, server.proc, server.log_path)
            name = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            bos = client.get(f"{url}/tokenizer_info").json().get("bos_token")
            prefix = client.post(f"{url}/tokenize", json={"prompt": bos, "add_special_tokens": False}).json()["tokens"][0]
        served = evaluate("local-completions", f"base_url={url}/v1/completions,model={name},max_retries=1,"
                                               f"custom_prefix_token_id={prefix},max_length=2048", task_dir, args.batch_size)
    finally:
        stop_server(server)
    reference = evaluate("hf", f"pretrained={path},dtype={args.dtype},device={args.device},max_length=2048,"
                                "add_bos_token=False", task_dir, args.batch_size)

    ours, theirs = metrics_of(served["results"]), metrics_of(reference["results"])
    a, b = per_request_scores(served["samples"]), per_request_scores(reference["samples"])
    rows = []
    print(f"\n| Task | Metric | Locus (local-completions) | transformers (hf) | Difference |")
    print("|---|---|---|---|---|")
    for task in TASKS:
        for metric in sorted(theirs[task]):
            x, y = ours[task][metric], theirs[task][metric]
            rows.append({"task": task, "metric": metric, "locus": x, "transformers": y})
            print(f"| {task} | {metric} | {x:.6f} | {y:.6f} | {x - y:+.2e} |")
    diffs = {task: max(abs(x - y) for x, y in zip(a[task], b[task])) for task in TASKS}
    print()
    for task in TASKS:
        print(f"{task}: {len(a[task])} loglikelihoods, largest difference {diffs[task]:.2e} nats")
    print(f"time: local-completions {served['seconds']:.1f} s, hf {reference['seconds']:.1f} s")
    same_counts = all(len(a[t]) == len(b[t]) for t in TASKS)
    mc_same = [max(range(4), key=lambda j: a["locus_heldout_mc"][4 * i + j]) for i in range(len(a["locus_heldout_mc"]) // 4)] == \
              [max(range(4), key=lambda j: b["locus_heldout_mc"][4 * i + j]) for i in range(len(b["locus_heldout_mc"]) // 4)]
    result = {"model": str(args.model), "dtype": args.dtype, "device": args.device, "tasks": counts, "metrics": rows,
              "max_loglikelihood_difference": diffs, "same_choices": mc_same, "same_request_counts": same_counts,
              "seconds": {"local-completions": served["seconds"], "hf": reference["seconds"]},
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    ok = same_counts and mc_same and all(math.isclose(r["locus"], r["transformers"], rel_tol=1e-4) for r in rows)
    if not ok:
        print(f"{PROG}: the backends disagree", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
