"""A 20-step smoke training: loss falls, the checkpoint loads in Locus and in transformers with equal
logits, and a run resumed from its state ends where an uninterrupted one does."""

from __future__ import annotations

import json
import math

import pytest
import torch

from locus.engine.checkpoint.loader import load
from locus.engine.checkpoint.weights import load_model
from locus.errors import LocusError
from locus.training.corpus import build_corpus
from locus.training.train import RouterTap, TrainArgs, rows_batch, token_losses, train
from tests.training.conftest import make_tree

SMOKE = dict(size="smoke", vocab_size=300, seq_len=32, batch_size=8, lr=1e-2, warmup_steps=5, checkpoint_minutes=0,
             eval_tokens=256, final_eval_tokens=256, log_every=5, threads=1)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    out = root / "corpus"
    build_corpus(make_tree(root, repeat=8), out)
    return out


def run(out, corpus_dir, **kw):
    lines = []
    report = train(TrainArgs(out=str(out), corpus=str(corpus_dir), command="locus train (test)", **{**SMOKE, **kw}),
                   log=lines.append)
    return report, lines


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, corpus_dir):
    out = tmp_path_factory.mktemp("run")
    report, lines = run(out, corpus_dir, max_steps=20)
    return out, report, lines


def test_smoke_training_lowers_the_loss_and_logs_domains(smoke, corpus_dir):
    out, report, lines = smoke
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "step" in r]
    assert steps[0]["step"] == 1 and steps[-1]["step"] == 20
    assert abs(steps[0]["loss"] - math.log(300)) < 0.3  # a fresh model is near uniform
    # the split hashes document ids, which hold this run's temporary paths: which domains have a
    # held-out document varies from run to run
    domains = json.loads((corpus_dir / "sources.json").read_text())["domains"]
    losses = report["heldout_loss"]
    assert set(losses) == {d for d, v in domains.items() if v["documents"]["heldout"]} and "math" in losses
    assert all(v < math.log(300) - 0.5 for v in losses.values()), losses
    assert sum(losses.values()) / len(losses) < math.log(300) - 1.0, losses
    assert any(line.startswith("step 20/20") and " en " in line for line in lines)
    card = (out / "model" / "README.md").read_text()
    assert "locus train (test)" in card and "| math |" in card and "held-out loss" in card


def test_checkpoint_is_bf16_and_loads_in_locus(smoke):
    out, report, _ = smoke
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["moe_layers"] == [1, 3] and config["attention_chunk_size"] == 16
    assert config["no_rope_layers"] == [1, 1, 1, 0] and config["num_experts_per_tok"] == 1
    loaded = load(str(out / "model"), device="cpu")
    assert not loaded.random_weights and loaded.model.dtype == torch.bfloat16
    assert loaded.tokenizer.bos_token_id == 0 and loaded.tokenizer.eos_token_ids == (1,)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("def add(a, b):")) == "def add(a, b):"
    assert report["samples"] and all(text.startswith(prompt) for prompt, text in report["samples"].items())


def test_logits_equal_transformers(smoke):
    transformers = pytest.importorskip("transformers")
    out, _, _ = smoke
    ours = load_model(out / "model", dtype=torch.float32)
    hf = transformers.Llama4ForCausalLM.from_pretrained(str(out / "model"), dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(5, 300, (1, 40), generator=torch.Generator().manual_seed(0))  # 40 > the 16-token chunk
    with torch.no_grad():
        expected = hf(ids).logits[0].float()
        got = ours.compute_logits(ours(rows_batch(ids)).hidden)
    assert (got - expected).abs().max().item() < 1e-4
    assert expected.std() > 0.1


def test_router_tap_leaves_outputs_unchanged_and_balance_loss_is_one_when_uniform(smoke):
    out, _, _ = smoke
    model = load_model(out / "model", dtype=torch.float32)
    x = torch.randint(5, 300, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = token_losses(model, x)
        tap = RouterTap(model)
        after = token_losses(model, x)
        assert sorted(tap.logits) == [1, 3] and tap.logits[1].shape == (64, 4)
        tap.logits = {1: torch.zeros(64, 4)}  # equal logits: top-1 picks one expert for all, P uniform
        loss, counts = tap.balance_loss()
        tap.remove()
    assert torch.equal(before, after)
    assert loss.item() == pytest.approx(1.0) and sorted(counts[1].tolist()) == [0, 0, 0, 64]


def test_resume_ends_where_an_uninterrupted_run_does(smoke, tmp_path, corpus_dir):
    out, _, _ = smoke

    def interrupt_at_step_15(line):
        if line.startswith("step 15/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # killed after step 15: the state of step 10 is on disk
        train(TrainArgs(out=str(tmp_path), corpus=str(corpus_dir), max_steps=20, **{**SMOKE, "checkpoint_steps": 10}),
              log=interrupt_at_step_15)
    with pytest.raises(LocusError, match="--resume"):
        run(tmp_path, corpus_dir, max_steps=20)
    report, lines = run(tmp_path, corpus_dir, max_steps=20, resume=True)
    assert any(line.startswith("resumed") and "step 10" in line for line in lines)
    whole = torch.load(out / "state.pt", weights_only=False)
    resumed = torch.load(tmp_path / "state.pt", weights_only=False)
    assert resumed["step"] == whole["step"] == 20
    for name, tensor in whole["model"].items():
        assert torch.allclose(resumed["model"][name], tensor, atol=1e-6), name
    assert report["heldout_loss"] == pytest.approx(whole["history"][-1]["heldout_loss"], abs=1e-5)


def test_a_mini_run_defaults_to_the_shipped_step_count_and_0_removes_the_budget():
    """`locus train --max-minutes 60` trains the shipped run's steps (reproducible on any machine that
    gets there within the hour), not as many as the clock allows."""
    import argparse
    import json
    from pathlib import Path

    from locus.training.train import SHIPPED_STEPS, parse_args

    shipped = json.loads((Path(__file__).resolve().parents[2] / "locus/assets/mini/training.json").read_text())
    assert SHIPPED_STEPS == shipped["step"]
    args = parse_args(argparse.Namespace(out="x", max_minutes=60.0, max_steps=None, size=None))
    assert (args.max_steps, args.max_minutes) == (SHIPPED_STEPS, 60.0)
    assert parse_args(argparse.Namespace(out="x", max_minutes=60.0, max_steps=0, size=None)).max_steps is None
    assert parse_args(argparse.Namespace(out="x", max_minutes=None, max_steps=300, size=None)).max_steps == 300
    assert parse_args(argparse.Namespace(out="x", max_minutes=5.0, max_steps=None, size="smoke")).max_steps is None


class _RunsCode:
    """Pickles as a call of os.makedirs: what torch.load(weights_only=False) would run while loading."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return os.makedirs, (self.path,)


def resume_error(out, capsys) -> str:
    from locus.cli import main

    assert main(["train", "--out", str(out), "--resume", "--max-steps", "1", "--size", "smoke"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("locus: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_resume_never_runs_code_from_state_pt(tmp_path, capsys):
    """Issue 41, finding 9: --resume loaded state.pt with torch.load(weights_only=False), so a crafted
    file ran code."""
    ran = tmp_path / "ran"
    torch.save({"args": {}, "payload": _RunsCode(ran)}, tmp_path / "state.pt")
    err = resume_error(tmp_path, capsys)
    assert not ran.exists()
    assert f"{tmp_path / 'state.pt'}: not a readable training state (UnpicklingError: " in err


def test_a_truncated_or_foreign_state_is_one_line_naming_it(smoke, tmp_path, capsys):
    out, _, _ = smoke
    state = tmp_path / "state.pt"
    whole = (out / "state.pt").read_bytes()
    state.write_bytes(whole[: len(whole) // 2])
    assert f"{state}: not a readable training state" in resume_error(tmp_path, capsys)
    torch.save({"args": {}, "model": {}}, state)
    assert (f"{state}: not a training state of this Locus (no optimizer, rng, torch_rng, step, elapsed, history)"
            in resume_error(tmp_path, capsys))
    saved = torch.load(out / "state.pt", weights_only=True)
    torch.save({**saved, "args": {**saved["args"], "no_such_argument": 1}}, state)
    assert "its saved arguments are not this Locus's" in resume_error(tmp_path, capsys)


def test_a_state_whose_model_does_not_fit_is_one_line_naming_it(smoke, tmp_path, capsys):
    import shutil

    out, _, _ = smoke
    run_dir = tmp_path / "run"
    shutil.copytree(out, run_dir)
    saved = torch.load(run_dir / "state.pt", weights_only=True)
    saved["model"].pop(next(iter(saved["model"])))
    saved["args"]["out"] = str(run_dir)
    torch.save(saved, run_dir / "state.pt")
    err = resume_error(run_dir, capsys)
    assert f"{run_dir / 'state.pt'}: its model does not fit this run (RuntimeError: Error(s) in loading state_dict" in err
