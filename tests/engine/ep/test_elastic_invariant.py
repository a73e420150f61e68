"""The elastic invariant and the rendezvous, in one process (issue 41): a rank answers only with the
placement every rank holds; a re-plan made for another membership never reaches the survivors; a
fault of a rank's own is never taken for a lost peer; a value in the rendezvous store that no rank of
the launch signed is refused; the EP flags that used to pass or log tracebacks are refused."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from locus.engine.ep.ranks.control import DIGEST, FIXED_FIELDS, Agreement
from locus.engine.ep.ranks.elastic import lost_peer, new_plan_of, plan_onto, ready_barrier, RegroupRestart, rendezvous_members
from locus.engine.ep.invariant import BROKEN, PlacementDisagreement, expert_fingerprint, wrong_slots
from locus.engine.ep.placement_move import PlacementMove
from locus.engine.ep.placement import ExpertPlacement
from locus.engine.ep.ranks.rendezvous import RendezvousRefused, SignedStore
from locus.engine.ep.rebalance.replan import ReplanAborted, ReplanDecision, Replanner, ReplanSchedule
from locus.errors import LocusError
from locus.routing.planners.baselines import round_robin
from locus.routing.plan.topology import Topology

LAYERS = (0, 1, 3)


def plan_2x2():
    return round_robin(8, LAYERS, Topology(2, 2, 3), model="tiny")


# --- the rendezvous store -------------------------------------------------------------------------------
def test_a_plan_written_without_the_launch_secret_is_never_loaded():
    """Finding 2: a client of the store that writes the survivors' plan key used to make them load its
    placement. Now every value is signed: a forged one is refused (never loaded), a signed one read."""
    raw = dist.HashStore()
    rank0, rank1 = SignedStore(raw, "launch secret"), SignedStore(raw, "launch secret")
    real = plan_onto(plan_2x2(), [0, 1, 3], max_slots=8)
    assert new_plan_of(rank0, 1, 0, lambda: real, timeout=1).to_dict() == real.to_dict()
    assert new_plan_of(rank1, 1, 1, None, timeout=1).to_dict() == real.to_dict()

    forged = plan_onto(round_robin(8, LAYERS, Topology(2, 2, 3), model="tiny"), [0, 2, 3], max_slots=8)
    raw.set(rank0.prefix + "g2/plan", forged.to_json())  # a client without the secret, unsigned
    with pytest.raises(RendezvousRefused, match="not written by a rank of this launch"):
        new_plan_of(rank1, 2, 1, None, timeout=0.2)
    SignedStore(raw, "another secret").store.set(rank0.prefix + "g2/plan", b"x" * 40 + forged.to_json().encode())
    with pytest.raises(RendezvousRefused):
        new_plan_of(rank1, 2, 1, None, timeout=0.2)
    # the signature covers the key: a value signed for another key does not pass either
    raw.set(rank0.prefix + "g2/plan", raw.get(rank0.prefix + "g1/plan"))
    with pytest.raises(RendezvousRefused):
        new_plan_of(rank1, 2, 1, None, timeout=0.2)


def test_a_forged_value_is_waited_past_until_the_real_one_comes():
    raw = dist.HashStore()
    store = SignedStore(raw, "s")
    raw.set(store.prefix + "g1/members", json.dumps({"members": [0, 1, 2, 3], "epoch": 0}))
    threading.Timer(0.2, store.set, ["g1/members", json.dumps({"members": [0, 1], "epoch": 4})]).start()
    assert rendezvous_members(store, 1, 1, [0, 1, 2], 0.1, 5.0) == ([0, 1], 4)


def test_the_ready_barrier_restarts_the_regroup_when_a_member_dies_before_joining():
    """Finding 3: a member that registered, then died before torch's rendezvous, held the survivors
    in init_process_group for the whole --ep-timeout. The barrier before it is polled: rank 0 calls
    the attempt off as soon as it sees the member is gone, and every member restarts."""
    store = SignedStore(dist.HashStore(), "s")
    members = [0, 1, 3]
    store.set("g1/ready/1", "1")
    started = time.monotonic()
    with pytest.raises(RegroupRestart, match=r"\[3\]"):
        ready_barrier(store, 1, 0, members, timeout=30, is_alive=lambda identity: identity != 3)
    with pytest.raises(RegroupRestart, match=r"\[3\]"):  # rank 1 reads rank 0's call
        ready_barrier(store, 1, 1, members, timeout=30)
    assert time.monotonic() - started < 5
    store.set("g2/ready/1", "1")
    ready_barrier(store, 2, 0, [0, 1], timeout=5, is_alive=lambda identity: True)  # everyone there: no restart


# --- what a regroup may and may not survive -------------------------------------------------------------
def test_a_fault_of_the_ranks_own_is_never_taken_for_a_lost_peer():
    """Finding 1: 'could not broadcast input array from shape (4,5) into shape (3,6)' was taken for a
    collective failure and triggered a regroup with lost_ranks []."""
    assert not lost_peer(ValueError("could not broadcast input array from shape (4,5) into shape (3,6)"))
    assert not lost_peer(PlacementDisagreement("ranks disagree"))
    assert not lost_peer(RuntimeError("a re-plan arrived while a placement move was still in progress"))
    assert not lost_peer(LocusError("--ep-max-slots"))
    assert lost_peer(RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                                  "[127.0.0.1]:29104: Connection reset by peer."))
    assert lost_peer(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                                  "3000ms for recv operation to complete"))
    assert lost_peer(dist.DistNetworkError("store gone"))
    assert lost_peer(RegroupRestart("rank(s) [3] did not join generation 1"))


def test_the_header_check_names_the_ranks_that_disagree():
    def agreement(*digests):
        headers = np.zeros((len(digests), FIXED_FIELDS + 2 * len(digests)), dtype=np.int64)
        headers[:, DIGEST] = digests
        return Agreement(headers)

    assert agreement(7, 7, 7).disagreement() is None
    assert "rank(s) [2] hold a placement other than rank 0's" in agreement(7, 7, 8).disagreement()
    assert "rank(s) [1] hold weights that do not match" in agreement(7, BROKEN, 7).disagreement()
    assert agreement(BROKEN, BROKEN).disagreement() is not None


def test_a_move_for_another_topology_overwrites_no_weight():
    """A decision made for four ranks cannot apply to three survivors: refused before any copy."""
    survivors = plan_onto(plan_2x2(), [0, 1, 3], max_slots=8)
    gate_up = torch.randn(4, 64, 128)
    layers = [SimpleNamespace(gate_up_proj=gate_up.clone(), down_proj=torch.randn(4, 64, 64)) for _ in LAYERS]
    before = [layer.gate_up_proj.clone() for layer in layers]
    runtime = SimpleNamespace(placement=ExpertPlacement.build(survivors, 0, epoch=1), layers=layers)
    with pytest.raises(PlacementDisagreement, match="cannot apply"):
        PlacementMove(plan_2x2()).advance(runtime)
    assert all(torch.equal(a.gate_up_proj, b) for a, b in zip(layers, before))


def test_a_slot_with_another_experts_weights_is_found():
    plan = plan_2x2()
    experts = {e: (torch.randn(64, 128), torch.randn(64, 64)) for e in range(8)}
    placement = ExpertPlacement.build(plan, 1)
    layers = [SimpleNamespace(gate_up_proj=torch.stack([experts[e][0] for e in placement.local_experts[row]]),
                              down_proj=torch.stack([experts[e][1] for e in placement.local_experts[row]]))
              for row in range(len(LAYERS))]
    reference = np.array([[expert_fingerprint(*experts[e]) for e in range(8)] for _ in LAYERS])
    runtime = SimpleNamespace(placement=placement, layers=layers, fingerprints=reference)
    assert wrong_slots(runtime) == []
    layers[2].gate_up_proj[0].copy_(layers[2].gate_up_proj[1])
    assert wrong_slots(runtime) == [(2, placement.local_experts[2][0])]
    assert placement.digest != ExpertPlacement.build(plan, 1, epoch=1).digest  # the epoch is part of it
    assert placement.digest == ExpertPlacement.build(plan, 2).digest  # every rank's digest of one placement


# --- the re-planner -------------------------------------------------------------------------------------
class FakeDriver:
    """What the re-planner asks of EPDriver."""

    def __init__(self):
        self.world, self.commands, self.tokens = 4, {}, 100
        self.runtime = SimpleNamespace(placement=ExpertPlacement.build(plan_2x2(), 0), move=None)
        self.worker = SimpleNamespace(window_tokens=lambda: "window of rank 0")

    def command(self, rank):
        return self.commands.setdefault(rank, SimpleNamespace(send_window=False, replan=None))

    def has_replan_queued(self):
        return any(c.replan is not None for c in self.commands.values())

    def tokens_run(self):
        return self.tokens

    def adopt_grouping(self, plan):
        pass


def planning_replanner(monkeypatch, release: threading.Event) -> tuple[Replanner, FakeDriver, Future]:
    driver = FakeDriver()
    replanner = Replanner(driver, meta=None, schedule=ReplanSchedule())
    decision = ReplanDecision(True, "forced", "locality", 10, 1.0, 0.5, 10, 5, 1, 0, 3, 0.1)

    def decide(self, windows, current, force):
        release.wait(10)
        return decision, current

    monkeypatch.setattr(Replanner, "_decide", decide)
    future = replanner.request(force=True)
    replanner.before_iteration(stepped=True)
    for rank in range(1, 4):
        replanner.take_window(rank, f"window of rank {rank}")
    assert replanner.state == "planning"
    return replanner, driver, future


def test_a_replan_made_for_another_membership_is_discarded(monkeypatch):
    """Finding 1: a decision made for four ranks was applied to the three survivors of a loss."""
    release = threading.Event()
    replanner, driver, future = planning_replanner(monkeypatch, release)
    replanner.membership_changed()  # EPDriver.recover: a rank was lost while it planned
    release.set()
    with pytest.raises(ReplanAborted, match="nothing moved"):
        future.result(5)
    time.sleep(0.05)
    replanner.after_iteration()
    assert replanner.state == "idle" and not driver.has_replan_queued()

    # the same when the placement changed under a decision by any other way: never sent
    release = threading.Event()
    replanner, driver, future = planning_replanner(monkeypatch, release)
    driver.runtime.placement = ExpertPlacement.build(plan_onto(plan_2x2(), [0, 1, 3], 8), 0, epoch=1)
    release.set()
    replanner._planning.exception(5)
    replanner.after_iteration()
    with pytest.raises(ReplanAborted):
        future.result(5)
    assert replanner.state == "idle" and not driver.has_replan_queued()


def test_a_replan_carries_the_placement_it_was_made_from(monkeypatch):
    release = threading.Event()
    release.set()
    replanner, driver, future = planning_replanner(monkeypatch, release)
    replanner._planning.exception(5)
    replanner.after_iteration()
    assert future.result(5).applied and replanner.state == "moving"
    assert {driver.commands[r].replan.base for r in range(4)} == {driver.runtime.placement.digest}


def test_a_scheduled_replan_with_nothing_run_starts_nothing_and_a_refusal_logs_no_traceback(caplog, monkeypatch):
    driver = FakeDriver()
    replanner = Replanner(driver, meta=None, schedule=ReplanSchedule(seconds=1.0))
    monkeypatch.setattr(replanner, "_last", time.monotonic() - 2)
    replanner.before_iteration(stepped=False)  # due: a re-plan of what ran since start
    assert replanner.state == "collecting"
    replanner._windows, replanner.state = {}, "idle"
    monkeypatch.setattr(replanner, "_last", time.monotonic() - 2)
    replanner.before_iteration(stepped=False)  # due again, but no token ran since: nothing to plan
    assert replanner.state == "idle"

    failed: Future = Future()
    failed.set_exception(LocusError("the routing window is empty: nothing to re-plan from yet"))
    replanner._planning, replanner.state = failed, "planning"
    with caplog.at_level(logging.INFO, logger="locus.engine"):
        replanner.after_iteration()
    assert replanner.state == "idle"
    assert "window is empty" in caplog.text and not any(r.exc_info for r in caplog.records)


def test_a_replan_leaves_no_temporary_directory(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    replanner = Replanner(FakeDriver(), meta=None, schedule=ReplanSchedule())
    seen = []
    monkeypatch.setattr(Replanner, "_decide_in", lambda self, workdir, *a: seen.append(workdir.exists()) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        replanner._decide({}, None, False)
    assert seen == [True] and list(tmp_path.iterdir()) == []


# --- flags ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0.000001", "0.5", "1e-9s", "inf"])
def test_replan_every_below_a_second_is_refused(value):
    with pytest.raises(LocusError, match="--replan-every"):
        ReplanSchedule.parse(value)
    assert ReplanSchedule.parse("1") == ReplanSchedule(seconds=1.0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0])
def test_ep_timeout_must_be_a_finite_positive_number(value):
    from locus.engine.ep.ranks.launch import setup_from

    with pytest.raises(LocusError, match="--ep-timeout must be a positive number of seconds"):
        setup_from(4, 2, value, None)
    with pytest.raises(LocusError, match="--ep-timeout"):  # refused on a single-process server too
        setup_from(1, None, value, None)


@pytest.mark.parametrize("flags,message", [
    (["--ep-timeout", "nan"], "--ep-timeout must be a positive number of seconds, not nan"),
    (["--ep-ranks", "2", "--ep-timeout", "inf"], "--ep-timeout must be a positive number of seconds, not inf"),
    (["--ep-ranks", "2", "--replan-every", "0.000001"], "--replan-every '0.000001': at least 1 s between re-plans"),
])
def test_bad_ep_flags_are_one_line_at_start(flags, message, capsys, monkeypatch):
    """The issue's `--ep-timeout nan|inf` printed a traceback before its error; every refusal is one
    line and exit code 2, before any model loads or rank starts."""
    from locus.cli import main

    monkeypatch.setenv("LOCUS_DEBUG", "0")
    assert main(["serve", "--model", "tiny", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"locus: error: {message}") and err.count("\n") == 1 and "Traceback" not in err
