"""`locus train`: a small Llama-4-style MoE trained on the package corpus, in plain PyTorch on CPU.

The model is Locus's own `Llama4ForCausalLM` (moe_backend "torch": the reference expert path, which
autograd differentiates), so every Llama-4 rule the server applies is what training applies: top-1
sigmoid routing whose weight scales the expert's input, a shared expert, MoE layers interleaved with
dense ones (`interleave_moe_layer_step`), RoPE layers attending within chunks of `attention_chunk_size`
tokens, every 4th layer NoPE with attention-temperature tuning, qk-norm.

Loss = next-token cross-entropy + aux_coef * load-balancing loss. The load-balancing loss (Switch
Transformer's) is E * sum_e f_e * P_e per MoE layer, f_e the share of tokens whose top-k holds expert e
and P_e the mean softmax probability of e over the router logits; it is read from the routers with
forward hooks (RouterTap), so the model's forward outputs stay those of serving.

Batches: each row is one domain (domains in turn, so every domain is seen equally often) and a window
of seq_len + 1 tokens at a random offset of that domain's training token stream (documents as
<|begin_of_text|> text <|eot|>, concatenated). Loss per domain is logged. The learning rate warms up,
then follows a cosine to 10% over the run's progress: the larger of steps / max_steps and
elapsed / max_minutes (a time-limited run anneals by the clock).

Output directory:
    corpus/          documents.jsonl + sources.json (unless --corpus names an existing one)
    tokenizer.json   the trained BPE
    data/            token streams per domain and split (.npy)
    state.pt         the training state (fp32 weights, optimizer, step, clocks, RNG) for --resume
    log.jsonl        one line per logged step and per evaluation
    model/           the HuggingFace-format checkpoint (bfloat16 safetensors, tokenizer, model card)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from locus.engine.checkpoint.weights import save_checkpoint
from locus.engine.model.config import ModelConfig, RopeConfig
from locus.engine.model.forward_batch import ForwardBatch, SequenceSpan
from locus.engine.model.kv_cache import ContiguousKVCache
from locus.engine.model.model import Llama4ForCausalLM
from locus.engine.model.moe import MoEBlock
from locus.errors import LocusError
from locus.training import corpus as corpus_mod
from locus.training import tokenizer as tok_mod

# Model shapes. "mini" is the shipped model (~7M parameters, 14 MB in bfloat16); "smoke" is for tests.
SIZES: dict[str, dict] = {
    "mini": dict(hidden_size=256, intermediate_size=256, intermediate_size_mlp=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                 num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=128, floor_scale=128),
    "smoke": dict(hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                  num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=16),
}
SAMPLE_PROMPTS = ("def fibonacci(n):", "#include <stdio.h>\n", "The meaning of life is", "Der Sinn des Lebens ist",
                  "La vida es", "La vita è", "12 + 35 =")


def model_config(size: str, vocab_size: int, specials: dict[str, int], max_positions: int) -> ModelConfig:
    s = dict(SIZES[size])
    L, step = s.pop("num_hidden_layers"), s.pop("interleave_moe_layer_step")
    return ModelConfig(
        **s, vocab_size=vocab_size, num_hidden_layers=L,
        moe_layers=tuple(range(step - 1, L, step)),  # Llama-4's interleave rule
        no_rope_layers=tuple(int((i + 1) % 4 != 0) for i in range(L)),  # every 4th layer NoPE
        attn_scale=0.1, max_position_embeddings=max_positions, rope=RopeConfig(theta=10000.0),
        bos_token_id=specials["bos"], eos_token_id=(specials["eos"],), pad_token_id=specials["pad"], dtype="bfloat16",
    )


@dataclass
class TrainArgs:
    out: str
    corpus: str | None = None
    size: str = "mini"
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 50
    aux_coef: float = 0.01
    max_steps: int | None = None
    max_minutes: float | None = None
    checkpoint_minutes: float = 5.0
    checkpoint_steps: int | None = None  # also checkpoint every N steps
    eval_tokens: int = 4096  # held-out tokens per domain at each checkpoint
    final_eval_tokens: int = 32768  # ... and at the end
    log_every: int = 10
    seed: int = 0
    threads: int | None = None
    max_bytes_per_domain: int = 3_000_000
    install_packages: bool = False
    resume: bool = False
    command: str = ""
    corpus_spec: dict = field(default_factory=dict)  # CorpusSpec overrides (tests: fake source dirs)


# --- data ---------------------------------------------------------------------------------------------

def prepare_data(args: TrainArgs, out: Path, log) -> tuple[dict, dict]:
    """Corpus, tokenizer and token streams in `out` (each reused when already there).
    Returns ({(domain, split): int32 array}, the corpus sources summary)."""
    corpus_dir = Path(args.corpus) if args.corpus else out / "corpus"
    if not (corpus_dir / "documents.jsonl").is_file():
        if args.install_packages:
            log(f"installing corpus packages: {', '.join(corpus_mod.install_packages()) or 'none missing'}")
        spec = corpus_mod.CorpusSpec(max_bytes=args.max_bytes_per_domain, seed=args.seed,
                                     **{k: (Path(v) if k.endswith("root") else v) for k, v in args.corpus_spec.items()})
        log(f"building the corpus in {corpus_dir}")
        corpus_mod.build_corpus(spec, corpus_dir)
    sources = json.loads((corpus_dir / "sources.json").read_text())
    tok_path = out / "tokenizer.json"
    if not tok_path.is_file():
        log(f"training a byte-level BPE of {args.vocab_size} ids")
        tok = tok_mod.train_tokenizer((d["text"] for d in corpus_mod.read_corpus(corpus_dir) if d["split"] == "train"),
                                      args.vocab_size)
        tok.save(str(tok_path))
    tok = tok_mod.load_trained(tok_path)
    data_dir = out / "data"
    if not (data_dir / "done").is_file():
        log("tokenizing the corpus")
        data_dir.mkdir(parents=True, exist_ok=True)
        ids = tok_mod.special_ids(tok)
        texts: dict[tuple[str, str], list[str]] = {}
        for d in corpus_mod.read_corpus(corpus_dir):
            texts.setdefault((d["domain"], d["split"]), []).append(d["text"])
        for (domain, split), docs in sorted(texts.items()):
            enc = tok.encode_batch(docs, add_special_tokens=False)
            stream = np.fromiter((t for e in enc for t in (ids["bos"], *e.ids, ids["eos"])), dtype=np.int32)
            np.save(data_dir / f"{domain}.{split}.npy", stream)
        (data_dir / "done").write_text("")
    streams = {}
    for path in sorted(data_dir.glob("*.npy")):
        domain, split = path.stem.split(".")
        streams[(domain, split)] = np.load(path)
    return streams, sources


def train_domains(streams: dict, seq_len: int) -> list[str]:
    """Domains with enough training and held-out tokens for one window, in DOMAINS order."""
    have = {d for (d, s), a in streams.items() if s == "train" and len(a) > seq_len + 1}
    return [d for d in corpus_mod.DOMAINS if d in have] + sorted(have - set(corpus_mod.DOMAINS))


def sample_batch(streams: dict, domains: list[str], step: int, batch_size: int, seq_len: int,
                 rng: np.random.Generator) -> tuple[torch.Tensor, list[str]]:
    rows, names = [], []
    for b in range(batch_size):
        domain = domains[(step * batch_size + b) % len(domains)]
        stream = streams[(domain, "train")]
        start = int(rng.integers(0, len(stream) - seq_len - 1))
        rows.append(stream[start:start + seq_len + 1])
        names.append(domain)
    return torch.from_numpy(np.stack(rows).astype(np.int64)), names


def rows_batch(x: torch.Tensor) -> ForwardBatch:
    """B rows of S tokens as B sequences starting at position 0 (no KV cache)."""
    B, S = x.shape
    return ForwardBatch(input_ids=x.reshape(-1), positions=torch.arange(S).repeat(B),
                        spans=[SequenceSpan(b, 0, S) for b in range(B)])


# --- model --------------------------------------------------------------------------------------------

class RouterTap:
    """Collects every MoE layer's router logits [T, E] during a forward pass (forward hooks on the
    routers: the model's outputs are unchanged)."""

    def __init__(self, model: Llama4ForCausalLM):
        self.logits: dict[int, torch.Tensor] = {}
        self.top_k = model.config.num_experts_per_tok
        self._handles = []
        for i, layer in enumerate(model.model.layers):
            if isinstance(layer.feed_forward, MoEBlock):
                self._handles.append(layer.feed_forward.router.register_forward_hook(self._hook(i)))

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            self.logits[layer] = output
        return hook

    def clear(self) -> None:
        self.logits.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def balance_loss(self) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(mean over MoE layers of E * sum_e f_e * P_e, tokens per expert per layer)."""
        losses, counts = [], {}
        for layer, logits in self.logits.items():
            E = logits.shape[-1]
            chosen = torch.topk(logits, self.top_k, dim=-1).indices
            load = torch.zeros(E).index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
            frac = load / chosen.numel()
            prob = torch.softmax(logits.float(), dim=-1).mean(0)
            losses.append(E * (frac * prob).sum())
            counts[layer] = load
        return torch.stack(losses).mean(), counts


@torch.no_grad()
def init_weights(model: Llama4ForCausalLM, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) weights (output projections scaled by 1/sqrt(2 L), GPT-2 style), unit norms."""
    gen = torch.Generator().manual_seed(seed)
    scale_out = 1.0 / math.sqrt(2 * model.config.num_hidden_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        s = std * (scale_out if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else 1.0)
        param.copy_(torch.randn(param.shape, generator=gen) * s)


def token_losses(model: Llama4ForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """[B, S] next-token cross-entropy of rows x [B, S + 1]."""
    B = x.shape[0]
    hidden = model(rows_batch(x[:, :-1])).hidden
    logits = model.compute_logits(hidden)
    return F.cross_entropy(logits, x[:, 1:].reshape(-1), reduction="none").view(B, -1)


@torch.no_grad()
def evaluate(model: Llama4ForCausalLM, streams: dict, domains: list[str], seq_len: int, max_tokens: int,
             batch_size: int = 8) -> dict[str, float]:
    """Mean held-out loss (nats per token) per domain over its first max_tokens predicted tokens
    (non-overlapping windows from the start of the held-out stream: the same tokens every time)."""
    was_training = model.training
    model.eval()
    out = {}
    for domain in domains:
        stream = streams.get((domain, "heldout"))
        if stream is None or len(stream) < 2:
            continue
        windows = heldout_windows(stream, seq_len, max_tokens)
        total, n = 0.0, 0
        for i in range(0, len(windows), batch_size):
            x = torch.from_numpy(np.stack(windows[i:i + batch_size]).astype(np.int64))
            losses = token_losses(model, x)
            total += losses.sum().item()
            n += losses.numel()
        out[domain] = total / n
    model.train(was_training)
    return out


def heldout_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> list[np.ndarray]:
    """Non-overlapping windows of seq_len + 1 tokens (or one shorter window) covering <= max_tokens targets."""
    S = min(seq_len, len(stream) - 1)
    n = max(1, min(max_tokens // S, (len(stream) - 1) // S))
    return [stream[i * S:i * S + S + 1] for i in range(n)]


def unigram_entropy(streams: dict, domains: list[str], vocab_size: int, seq_len: int, max_tokens: int) -> dict[str, float]:
    """Cross-entropy (nats per token) of each domain's training unigram distribution (add-one smoothed)
    on the same held-out targets `evaluate` scores: the bar a model that ignores context would reach."""
    out = {}
    for domain in domains:
        held = streams.get((domain, "heldout"))
        if held is None or len(held) < 2:
            continue
        counts = np.bincount(streams[(domain, "train")], minlength=vocab_size).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        targets = np.concatenate([w[1:] for w in heldout_windows(held, seq_len, max_tokens)])
        out[domain] = float(-logp[targets].mean())
    return out


@torch.no_grad()
def sample(model: Llama4ForCausalLM, prompt_ids: list[int], max_tokens: int, stop_ids: tuple[int, ...],
           temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[int]:
    """Top-k sampling with a KV cache (for the model card's examples)."""
    gen = torch.Generator().manual_seed(seed)
    cache = ContiguousKVCache(model.config, 1, len(prompt_ids) + max_tokens, model.dtype, model.device)
    batch, out = ForwardBatch.single(prompt_ids), []
    for _ in range(max_tokens):
        logits = model.compute_logits(model(batch, cache).hidden[-1:])[0] / temperature
        values, ids = torch.topk(logits, top_k)
        token = int(ids[torch.multinomial(torch.softmax(values, -1), 1, generator=gen)])
        if token in stop_ids:
            break
        out.append(token)
        batch = ForwardBatch.single([token], start=len(prompt_ids) + len(out) - 1)
    return out


# --- the loop -----------------------------------------------------------------------------------------

# Steps of the shipped locus/assets/mini run (its training.json); the default step budget of a mini run.
SHIPPED_STEPS = 1325


def lr_at(args: TrainArgs, step: int, elapsed: float) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = 0.0
    if args.max_steps:
        progress = max(progress, step / args.max_steps)
    if args.max_minutes:
        progress = max(progress, elapsed / (60 * args.max_minutes))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(model: Llama4ForCausalLM, args: TrainArgs) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed_tokens" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def train(args: TrainArgs, log=print) -> dict:
    """Run (or resume) training; returns the final report (also in model/training.json)."""
    if args.max_steps is None and args.max_minutes is None:
        raise LocusError("give --max-steps or --max-minutes (or both)")
    out = Path(args.out)
    state_path = out / "state.pt"
    state = None
    if state_path.is_file():
        if not args.resume:
            raise LocusError(f"{state_path} exists: pass --resume to continue that run, or choose another --out")
        state = load_state(state_path)
        saved = state["args"]
        # the run's identity comes from the saved arguments; the limits and logging from this command
        for keep in ("max_steps", "max_minutes", "checkpoint_minutes", "checkpoint_steps", "log_every", "threads", "eval_tokens", "final_eval_tokens"):
            setattr(saved, keep, getattr(args, keep))
        saved.command = args.command or saved.command
        args = saved
    elif args.resume:
        raise LocusError(f"--resume: no {state_path} to resume from")
    if args.size not in SIZES:
        raise LocusError(f"--size {args.size!r}: choose one of {', '.join(SIZES)}")
    out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    streams, sources = prepare_data(args, out, log)
    tok = tok_mod.load_trained(out / "tokenizer.json")
    specials = tok_mod.special_ids(tok)
    domains = train_domains(streams, args.seq_len)
    if not domains:
        raise LocusError("no domain has enough tokens for one training window (a larger corpus, or a smaller --seq-len)")
    config = model_config(args.size, tok.get_vocab_size(), specials, max_positions=max(2048, 8 * args.seq_len))
    model = Llama4ForCausalLM(config, moe_backend="torch")
    init_weights(model, args.seed)
    model.train()
    opt = make_optimizer(model, args)
    rng = np.random.default_rng(args.seed)
    step, elapsed, history = 0, 0.0, []
    if state is not None:
        restore_state(state_path, state, model, opt, rng)
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        log(f"resumed {out} at step {step} ({elapsed / 60:.1f} min trained)")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, {config.num_hidden_layers} layers (MoE {list(config.moe_layers)}), "
        f"{config.num_local_experts} experts top-{config.num_experts_per_tok}, vocab {config.vocab_size}; "
        f"domains {', '.join(domains)}; {args.batch_size} x {args.seq_len} tokens a step")

    tap = RouterTap(model)
    log_file = (out / "log.jsonl").open("a")
    ema: dict[str, float] = {}
    ema_loss = ema_aux = None
    last_ckpt = time.monotonic()
    tokens_since, t_since = 0, time.monotonic()

    def limit_reached() -> bool:
        return bool((args.max_steps and step >= args.max_steps) or (args.max_minutes and elapsed >= 60 * args.max_minutes))

    try:
        while not limit_reached():
            t0 = time.monotonic()
            x, names = sample_batch(streams, domains, step, args.batch_size, args.seq_len, rng)
            for group in opt.param_groups:
                group["lr"] = lr_at(args, step, elapsed)
            tap.clear()
            losses = token_losses(model, x)
            loss = losses.mean()
            aux, counts = tap.balance_loss()
            opt.zero_grad(set_to_none=True)
            (loss + args.aux_coef * aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            elapsed += time.monotonic() - t0
            tokens_since += x.shape[0] * args.seq_len

            row = losses.detach().mean(1)
            for name, value in zip(names, row.tolist()):
                ema[name] = value if name not in ema else 0.9 * ema[name] + 0.1 * value
            ema_loss = loss.item() if ema_loss is None else 0.9 * ema_loss + 0.1 * loss.item()
            ema_aux = aux.item() if ema_aux is None else 0.9 * ema_aux + 0.1 * aux.item()
            if step % args.log_every == 0 or step == 1:
                now = time.monotonic()
                imbalance = max((c.max() / c.mean()).item() for c in counts.values())
                rate = tokens_since / max(now - t_since, 1e-9)
                tokens_since, t_since = 0, now
                budget = f"/{args.max_steps}" if args.max_steps else ""
                clock = f"{elapsed / 60:5.1f}" + (f"/{args.max_minutes:g}" if args.max_minutes else "") + " min"
                log(f"step {step}{budget} {clock} loss {ema_loss:.3f} aux {ema_aux:.3f} max/mean load {imbalance:.2f} "
                    f"lr {opt.param_groups[0]['lr']:.2e} {rate:.0f} tok/s | "
                    + " ".join(f"{d} {v:.2f}" for d, v in ema.items()))
                log_file.write(json.dumps({"step": step, "elapsed_s": round(elapsed, 1), "loss": loss.item(), "aux": aux.item(),
                                           "lr": opt.param_groups[0]["lr"], "domain_loss": dict(zip(names, row.tolist())),
                                           "max_over_mean_load": imbalance}) + "\n")
                log_file.flush()
            due = (args.checkpoint_minutes and time.monotonic() - last_ckpt >= 60 * args.checkpoint_minutes) or (
                args.checkpoint_steps and step % args.checkpoint_steps == 0)
            if due and not limit_reached():
                history.append(checkpoint(model, opt, rng, args, step, elapsed, history, streams, domains, sources,
                                          args.eval_tokens, log, log_file))
                last_ckpt = time.monotonic()
    finally:
        tap.remove()
    checkpoint(model, opt, rng, args, step, elapsed, history, streams, domains, sources, args.final_eval_tokens, log,
               log_file, final=True)
    log_file.close()
    return json.loads((out / "model" / "training.json").read_text())


STATE_KEYS = ("args", "model", "optimizer", "rng", "torch_rng", "step", "elapsed", "history")


def load_state(path: Path) -> dict:
    """state.pt for --resume, read with weights_only=True (tensors and plain containers only: a crafted
    file cannot run code) and checked, so a damaged one is a one-line error naming it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad or refused file
        first = (str(exc).strip().splitlines() or [""])[0]
        raise LocusError(f"{path}: not a readable training state ({type(exc).__name__}: {first})") from None
    if not isinstance(state, dict):
        raise LocusError(f"{path}: not a training state (it holds a {type(state).__name__}, not a dict)")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise LocusError(f"{path}: not a training state of this Locus (no {', '.join(missing)})")
    if not isinstance(state["step"], int) or not isinstance(state["elapsed"], (int, float)) or \
            not isinstance(state["history"], list):
        raise LocusError(f"{path}: step, elapsed or history has the wrong type")
    try:
        state["args"] = TrainArgs(**state["args"])
    except TypeError as exc:
        raise LocusError(f"{path}: its saved arguments are not this Locus's ({exc})") from None
    return state


def restore_state(path: Path, state: dict, model: Llama4ForCausalLM, opt: torch.optim.Optimizer,
                  rng: np.random.Generator) -> None:
    """Put a loaded state into the model, optimizer and random generators; a part that does not fit
    (other shapes, other parameters) is an error naming the file and the part."""
    parts = (("model", lambda v: model.load_state_dict(v)), ("optimizer", lambda v: opt.load_state_dict(v)),
             ("rng", lambda v: setattr(rng.bit_generator, "state", v)), ("torch_rng", torch.set_rng_state))
    for key, put in parts:
        try:
            put(state[key])
        except (RuntimeError, ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise LocusError(f"{path}: its {key} does not fit this run ({type(exc).__name__}: {first})") from None


def checkpoint(model, opt, rng, args: TrainArgs, step: int, elapsed: float, history: list, streams: dict,
               domains: list[str], sources: dict, eval_tokens: int, log, log_file, final: bool = False) -> dict:
    """Evaluate, write state.pt (atomically) and export model/ (replaced atomically). Returns the eval record."""
    out = Path(args.out)
    heldout = evaluate(model, streams, domains, args.seq_len, eval_tokens)
    unigram = unigram_entropy(streams, domains, model.config.vocab_size, args.seq_len, eval_tokens)
    record = {"step": step, "elapsed_s": round(elapsed, 1), "eval_tokens_per_domain": eval_tokens,
              "heldout_loss": heldout, "unigram_entropy": unigram}
    log("held-out loss (nats/token; unigram in brackets): "
        + " ".join(f"{d} {v:.3f} ({unigram[d]:.2f})" for d, v in heldout.items()))
    log_file.write(json.dumps({"eval": record}) + "\n")
    log_file.flush()
    state = {"args": asdict(args), "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng.bit_generator.state,
             "torch_rng": torch.get_rng_state(), "step": step, "elapsed": elapsed, "history": [*history, record]}
    tmp = out / "state.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, out / "state.pt")
    export_model(model, args, out, record, sources, final)
    return record


def export_model(model: Llama4ForCausalLM, args: TrainArgs, out: Path, record: dict, sources: dict, final: bool) -> Path:
    """out/model: bfloat16 safetensors + config.json (Locus's checkpoint writer), tokenizer files, the
    model card and training.json."""
    import copy

    tok = tok_mod.load_trained(out / "tokenizer.json")
    bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
    staging = out / f".model-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    save_checkpoint(bf16, staging)
    tok_mod.save_tokenizer_files(tok, staging, model.config.max_position_embeddings)
    samples = {}
    if final:
        stop = model.config.eos_token_ids
        for i, prompt in enumerate(SAMPLE_PROMPTS):
            ids = tok.encode(prompt).ids
            samples[prompt] = prompt + tok.decode(sample(bf16, ids, 48, stop, seed=args.seed + i))
    n_params = sum(p.numel() for p in model.parameters())
    report = {**record, "final": final, "parameters": n_params, "size": args.size, "command": args.command,
              "seq_len": args.seq_len, "batch_size": args.batch_size, "tokens_seen": record["step"] * args.batch_size * args.seq_len,
              "seed": args.seed, "samples": samples}
    (staging / "training.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    (staging / "README.md").write_text(model_card(model.config, report, sources))
    (staging / "sources.json").write_text(json.dumps(sources, indent=2) + "\n")
    write_heldout_sample(Path(args.corpus) if args.corpus else out / "corpus", tok, staging)
    target, old = out / "model", out / f".model-old-{os.getpid()}"
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    if old.exists():
        shutil.rmtree(old)
    return target


def write_heldout_sample(corpus_dir: Path, tok, model_dir: Path, tokens_per_domain: int = 512) -> dict[str, list[str]]:
    """model_dir/heldout_sample.json: the first held-out documents of each domain (in corpus order, the
    ones `evaluate` scores first), about tokens_per_domain tokens each: what a test scores the shipped
    checkpoint on without the corpus packages installed."""
    sample: dict[str, list[str]] = {}
    count: dict[str, int] = {}
    for doc in corpus_mod.read_corpus(corpus_dir):
        domain = doc["domain"]
        if doc["split"] != "heldout" or count.get(domain, 0) >= tokens_per_domain:
            continue
        sample.setdefault(domain, []).append(doc["text"])
        count[domain] = count.get(domain, 0) + len(tok.encode(doc["text"], add_special_tokens=False).ids) + 2
    (model_dir / "heldout_sample.json").write_text(json.dumps(
        {"about": "held-out documents of the training corpus (licences: README.md, sources.json)", "documents": sample},
        indent=1, ensure_ascii=False) + "\n")
    return sample


def model_card(config: ModelConfig, report: dict, sources: dict) -> str:
    losses = "\n".join(f"| {d} | {v:.3f} | {report['unigram_entropy'][d]:.3f} |" for d, v in report["heldout_loss"].items())
    samples = "\n\n".join(f"```\n{text}\n```" for text in report["samples"].values()) or "(written at the end of a run)"
    return f"""---
license: other
library_name: locus
tags: [llama4, moe, tiny]
---
# Locus mini: a {report['parameters'] / 1e6:.1f}M-parameter Llama-4-style MoE trained on package text

A HuggingFace-format Llama-4 text checkpoint (`Llama4ForCausalLM`, bfloat16 safetensors) trained by
`locus train` on CPU from text that Debian packages ship (fortune cookies in several languages,
the Python standard library, C headers) and generated arithmetic. It is tiny and writes text that
*looks like* its domains, not text that is true or useful: it exists so that Locus serves a model
with readable output and learned (not random) expert routing.

## Shape
{config.num_hidden_layers} layers (MoE at {list(config.moe_layers)}, dense SwiGLU elsewhere; NoPE at
{[i for i, r in enumerate(config.no_rope_layers) if not r]}), hidden {config.hidden_size}, {config.num_attention_heads}
query / {config.num_key_value_heads} KV heads of {config.head_dim}, {config.num_local_experts} experts of width
{config.intermediate_size} with top-{config.num_experts_per_tok} sigmoid routing and a shared expert, dense width
{config.intermediate_size_mlp}, chunked attention ({config.attention_chunk_size} tokens) on RoPE layers,
vocabulary {config.vocab_size} (byte-level BPE, specials `<|begin_of_text|>` `<|eot|>` `<|pad|>`
`<|header_start|>` `<|header_end|>`). The chat template is Llama-4's header format; the model never
saw chat data, so plain completions work better than chat.

## Training
Command: `{report['command']}`

{report['step']} steps of {report['batch_size']} x {report['seq_len']} tokens ({report['tokens_seen']:,} tokens),
{report['elapsed_s'] / 60:.1f} minutes, seed {report['seed']}. Cross-entropy + 0.01 x load-balancing loss
(locus/training/train.py).

## Held-out loss per domain
Nats per token on the first {report['eval_tokens_per_domain']} held-out tokens of each domain (documents
held out by a hash of their id, locus/training/corpus.py), beside the cross-entropy of the domain's
training unigram distribution on the same tokens.

| domain | held-out loss | unigram entropy |
|---|---|---|
{losses}

## Sources and licences
Every document comes from a file of an installed Debian package (or is generated); `sources.json`
has the details. The weights are a statistical summary of these texts; the licences of the sources:

{corpus_mod.sources_table(sources)}

## Samples (temperature 0.8, top-k 40)
{samples}
"""


def parse_args(argv_args: argparse.Namespace) -> TrainArgs:
    """TrainArgs from `locus train`'s flags. A `mini` run without --max-steps gets the shipped run's step
    count (SHIPPED_STEPS), so `--max-minutes 60` trains what was shipped on any machine that gets there
    within the hour, instead of however many steps its CPU manages (a time budget is not reproducible);
    `--max-steps 0` removes the step budget."""
    names = {f for f in TrainArgs.__dataclass_fields__}
    values = {k: v for k, v in vars(argv_args).items() if k in names and v is not None}
    if "max_steps" not in values and values.get("size", "mini") == "mini":
        values["max_steps"] = SHIPPED_STEPS
    elif values.get("max_steps") == 0:
        values["max_steps"] = None
    values["command"] = "locus " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "locus train"
    return TrainArgs(**values)
