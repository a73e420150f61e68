"""Local search over one layer's slots: bring every rank's expected load under the cap, losing as few
local pairs as possible.

Each step looks at the most loaded rank w and scores, all at once, every move that touches one of its
slots:
  swap     w's replica of a trades places with a replica of b on any other rank;
  spread   a rank elsewhere replaces one of its replicas (of c, which keeps another copy) by a copy of
           w's expert a: a's load splits over one more replica, and if the new copy lands on a node
           that had none, that node's demand for a turns local;
  shed     w replaces its replica of a (which keeps another copy) by a copy of any expert f.
A move changes the replica counts of two experts only, so its effect on every rank's load is two
experts' contributions recomputed (expected_load's rule, own-rank tier included, with the remote split
`pull` when the caller measured one, dispatch_pull.py), for all candidate moves
in one batch. The move taken removes the most overload (sum over ranks of load above the target) per
local pair lost; moves that win local pairs score best. Deterministic: ties go to the first candidate.
At many ranks a move's overload change is summed over the ranks it touches only (move_scores.py):
the same rule per rank, fewer terms in the sum, so only exact or near ties may break differently. There
most candidates cannot win: a move removes at most the overload its touched ranks carry, and its local
pairs are cheap to count exactly, so each candidate's score has a cheap bound, and candidates are scored
exactly in batches, highest bound first, only until the best score found reaches the next bound
(_bounded_move): the same move as scoring them all.

Single moves get stuck when the worst rank holds one replica too heavy for any GPU (a node's own
demand for a hot expert): splitting it in two overloads whichever rank takes the second copy until the
node is repacked. Then a kick: the heaviest replica gets a second copy on its node (in place of the
node's cheapest replica, replica_selection.split_replica), the node is repacked (gpu_packing), and the
search goes on. The best state seen is returned.

Shape legend: R ranks, S slots per GPU, N nodes, G GPUs per node, E experts, B candidate moves.
    slots [R, S]   demand [N, E]   h [R, E] copies of e on rank r   contrib [E, R] load e puts on r
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from locus.routing.planners.gpu_packing import pack_replicas
from locus.routing.planners.expected_load import replica_loads
from locus.routing.plan.placement import node_replicas
from locus.routing.planners.replica_selection import split_replica
from locus.routing.planners.move_scores import ExpertState, overload_change

MAX_STEPS = 400
MAX_KICKS = 32
# Moves are scored on the ranks they touch (move_scores.py) when an expert's most copies, times this, stay
# under the rank count: each move then sums over far fewer ranks than all of them. Below that the dense
# scores below are cheaper (fewer, larger numpy operations).
TOUCHED_WIDTH = 4
# On the touched scores, candidates are scored exactly BATCH at a time, best bound first, until no bound left
# can beat the best score found (_bounded_move).
BATCH = 256


def copies_per_rank(slots: np.ndarray, num_experts: int) -> np.ndarray:
    R = slots.shape[0]
    keys = np.arange(R)[:, None] * num_experts + slots
    return np.bincount(keys.ravel(), minlength=R * num_experts).reshape(R, num_experts)


def contributions(demand_e: np.ndarray, h_e: np.ndarray, gpus: int, pull_e: np.ndarray | None = None) -> np.ndarray:
    """Load each expert puts on each rank, [B, R], from its node demand [B, N], copies h_e [B, R] and
    pull_e [B, N(source), N(holder)] (None: the even spread).

    Per node: ranks holding e keep their own share D / G; the node's other ranks spread theirs over the
    node's copies; the demand of nodes without e goes to the copies as expected_load.remote_loads says
    (expected_load.rank_loads).
    """
    B, R = h_e.shape
    N = R // gpus
    h = h_e.reshape(B, N, gpus).astype(np.float64)
    x = h.sum(-1)  # [B, N]
    has = h > 0
    with_e = has.sum(-1)  # [B, N] ranks of the node holding e
    remote = np.where(x > 0, 0.0, demand_e)  # [B, N]
    if pull_e is None:
        rho = np.broadcast_to((remote.sum(-1) / np.maximum(x.sum(-1), 1))[:, None], (B, N))  # [B, N] per copy
    else:
        denom = np.einsum("bnj,bj->bn", pull_e, x)
        rho = np.einsum("bn,bnj->bj", remote / np.maximum(denom, 1e-300), pull_e)
    per_rank = demand_e / gpus
    spill = np.where(x > 0, per_rank * (gpus - with_e) / np.maximum(x, 1), 0.0)  # [B, N] per copy
    load = has * per_rank[..., None] + h * (spill + rho)[..., None]
    return load.reshape(B, R)


def local_pairs(demand_e: np.ndarray, h_e: np.ndarray, gpus: int) -> np.ndarray:
    """Pairs served on their own node, [B]."""
    B, R = h_e.shape
    x = h_e.reshape(B, R // gpus, gpus).sum(-1)
    return (demand_e * (x > 0)).sum(-1)


def enforce_cap(demand: np.ndarray, slots: np.ndarray, gpus: int, target: float,
                max_steps: int = MAX_STEPS, max_kicks: int = MAX_KICKS, pull: np.ndarray | None = None) -> np.ndarray:
    """Slots [R, S] whose expected rank loads all lie at or under `target` if the search finds a way;
    otherwise the slots with the least overload it saw. pull [N, E, N]: expected_load's remote split
    (None: the even spread of the `position` rule)."""
    slots = slots.copy()
    R, S = slots.shape
    N, E = demand.shape
    eps = 1e-6 * max(float(demand.sum()) / R, 1e-12)
    dT = np.ascontiguousarray(demand.T)  # [E, N]
    pT = None if pull is None else np.ascontiguousarray(pull.transpose(1, 0, 2))  # [E, N(source), N(holder)]
    best, best_excess, kicks = slots.copy(), np.inf, 0
    h = None
    for _ in range(max_steps):
        if h is None:
            h = copies_per_rank(slots, E)  # [R, E]
            hT = np.ascontiguousarray(h.T)  # [E, R], kept equal to h.T below
            contrib = contributions(dT, hT, gpus, pT)  # [E, R]
            state = ExpertState.of(dT, hT, gpus) if pT is None else None
        loads = contrib.sum(0)
        excess = np.maximum(loads - target, 0.0).sum()
        if excess < best_excess - eps:
            best, best_excess = slots.copy(), excess
        if excess <= eps:
            break
        if state is not None and TOUCHED_WIDTH * int(state.holding.max()) < R:
            move = _bounded_move(dT, h, contrib, loads, slots, gpus, target, eps, state=state)
        else:
            move = _best_move(dT, h, contrib, loads, slots, gpus, target, excess, eps, pT)
        if move is None:
            if kicks >= max_kicks or not _kick(demand, slots, contrib, loads, gpus, pull):
                break
            kicks += 1
            h = None
            continue
        changed = []
        for rank, slot, expert in move:
            changed += [int(slots[rank, slot]), expert]
            h[rank, slots[rank, slot]] -= 1
            h[rank, expert] += 1
            hT[slots[rank, slot], rank] -= 1
            hT[expert, rank] += 1
            slots[rank, slot] = expert
        if pT is None:  # an expert's load depends on its own copies only: recompute the two that changed
            changed = np.unique(changed)
            contrib[changed] = contributions(dT[changed], hT[changed], gpus)
            state = state.refreshed(changed)
        else:
            contrib = contributions(dT, np.ascontiguousarray(h.T), gpus, pT)
    return best


def _kick(demand: np.ndarray, slots: np.ndarray, contrib: np.ndarray, loads: np.ndarray, gpus: int,
          pull: np.ndarray | None = None) -> bool:
    """Split the worst rank's heaviest replica on its own node and repack that node (in place)."""
    R, S = slots.shape
    N, E = demand.shape
    w = int(np.argmax(loads))
    node = w // gpus
    heavy = int(slots[w][np.argmax(contrib[slots[w], w])])
    x = node_replicas(slots[None], N, E)[0]
    if not split_replica(demand, x, node, heavy):
        return False
    experts = np.repeat(np.arange(E), x[node])  # [G * S]
    gpu = pack_replicas(replica_loads(demand, x, pull)[node, experts][None], gpus)[0]
    order = np.lexsort((experts, gpu))
    slots[node * gpus : (node + 1) * gpus] = experts[order].reshape(gpus, S)
    return True


def _best_move(dT, h, contrib, loads, slots, gpus, target, excess, eps, pT=None):
    if pT is None and TOUCHED_WIDTH * int((h > 0).sum(0).max()) < h.shape[0]:
        return _best_move_touched(dT, h, contrib, loads, slots, gpus, target, eps)
    R, S = slots.shape
    E = dT.shape[0]
    w = int(np.argmax(loads))
    total = h.sum(0)  # [E] copies of each expert
    flat = slots.ravel()  # [R * S] expert of every slot
    slot_rank = np.repeat(np.arange(R), S)
    a_w = slots[w]  # [S] w's experts
    hT = np.ascontiguousarray(h.T)  # [E, R]
    local_now = local_pairs(dT, hT, gpus)  # [E] each expert's local pairs before the move
    # A move changes two experts' copies, and each half depends on fewer things than the move: w's
    # expert a moving to rank r2 on (w's slot, r2); the other slot's expert moving to w on that slot;
    # so each distinct half is scored once ([S * R] and [R * S] rows) and gathered per move.
    a_to_r2 = _Half(dT, hT, local_now, gpus, pT, np.repeat(a_w, R), np.full(S * R, w), np.tile(np.arange(R), S))
    a_copy_r2 = _Half(dT, hT, local_now, gpus, pT, np.repeat(a_w, R), np.full(S * R, -1), np.tile(np.arange(R), S))
    other_to_w = _Half(dT, hT, local_now, gpus, pT, flat, slot_rank, np.full(R * S, w))
    other_dropped = _Half(dT, hT, local_now, gpus, pT, flat, slot_rank, np.full(R * S, -1))
    i = np.repeat(np.arange(S), R * S)  # w's slot
    j = np.tile(np.arange(R * S), S)  # any slot
    a, other, r2 = slots[w, i], flat[j], slot_rank[j]
    pair = i * R + r2  # row of (w's slot i, rank r2) in the p halves
    i3 = np.repeat(np.arange(S), E)
    f = np.tile(np.arange(E), S)
    a3 = slots[w, i3]
    f_to_w = _Half(dT, hT, local_now, gpus, pT, np.arange(E), np.full(E, -1), np.full(E, w))
    w_drops = _Half(dT, hT, local_now, gpus, pT, a_w, np.full(S, w), np.full(S, -1))
    # (p, its half and row, q, its half and row, ok, w's slot, other index, kind) per kind of move
    cands = [
        (a, a_to_r2, pair, other, other_to_w, j, (r2 != w) & (a != other), i, j, "swap"),
        (a, a_copy_r2, pair, other, other_dropped, j, (r2 != w) & (a != other) & (total[other] >= 2), i, j, "spread"),
        (a3, w_drops, i3, f, f_to_w, f, (a3 != f) & (total[a3] >= 2), i3, f, "shed"),
    ]

    best = None
    for p, p_half, p_row, q, q_half, q_row, ok, ii, jj, kind in cands:
        idx = np.flatnonzero(ok)
        if len(idx) == 0:
            continue
        p, q, p_row, q_row = p[idx], q[idx], p_row[idx], q_row[idx]
        new_loads = loads[None, :] - contrib[p] - contrib[q]
        new_loads += p_half.loads[p_row]
        new_loads += q_half.loads[q_row]
        gain_local = 0.0 + p_half.local_new[p_row] - p_half.local_old[p_row]
        gain_local = gain_local + q_half.local_new[q_row] - q_half.local_old[q_row]
        reduced = excess - np.maximum(new_loads - target, 0.0).sum(1)
        best = _better(best, reduced, gain_local, eps, kind, ii[idx], jj[idx])
    return _moves_of(best, w, slots)


def _better(best, reduced: np.ndarray, gain_local: np.ndarray, eps: float, kind: str, ii: np.ndarray,
            jj: np.ndarray):
    """The better of `best` and this kind's best candidate: overload removed per local share given up,
    only candidates that remove some overload (the first of equals kept)."""
    score = reduced / (np.maximum(-gain_local, 0.0) + eps)
    score[reduced <= eps] = -np.inf
    k = int(np.argmax(score))
    if np.isfinite(score[k]) and (best is None or score[k] > best[0]):
        return (score[k], kind, int(ii[k]), int(jj[k]))
    return best


def _moves_of(best, w: int, slots: np.ndarray) -> list[tuple[int, int, int]] | None:
    """The chosen candidate as slot writes (rank, slot, expert); None when no candidate helps."""
    if best is None:
        return None
    S = slots.shape[1]
    _, kind, i, j = best
    if kind == "swap":
        return [(w, i, int(slots.ravel()[j])), (j // S, j % S, int(slots[w, i]))]
    if kind == "spread":
        return [(j // S, j % S, int(slots[w, i]))]
    return [(w, i, j)]  # shed: j is the new expert

def _best_move_touched(dT, h, contrib, loads, slots, gpus, target, eps):
    """_best_move under the even spread, each move scored on the ranks it touches (move_scores.py): the
    same candidates in the same order, the same rule."""
    w = int(np.argmax(loads))
    c = _candidates(h, slots, np.array([w]))
    state = ExpertState.of(dT, np.ascontiguousarray(h.T), gpus)
    reduced, gain_local = overload_change(state, loads, contrib, target, *c.moves())
    best = None
    for kind in range(len(KINDS)):
        m = c.kind == kind
        if m.any():
            best = _better(best, reduced[m], gain_local[m], eps, KINDS[kind], c.i[m], c.j[m])
    return _moves_of(best, w, slots)


KINDS = ("swap", "spread", "shed")


@dataclass(frozen=True)
class Candidates:
    """Candidate moves of several overloaded ranks, [B] each: the rank `owner` whose slot i they change,
    the kind (index into KINDS), j (the other slot for swap and spread, the new expert for shed), and the
    two experts changed with the rank each loses a copy on and gains one on (-1: none)."""

    owner: np.ndarray
    kind: np.ndarray
    i: np.ndarray
    j: np.ndarray
    p: np.ndarray
    lose_p: np.ndarray
    get_p: np.ndarray
    q: np.ndarray
    lose_q: np.ndarray
    get_q: np.ndarray

    def moves(self) -> tuple[np.ndarray, ...]:
        return self.p, self.lose_p, self.get_p, self.q, self.lose_q, self.get_q

    def take(self, idx: np.ndarray) -> "Candidates":
        return Candidates(*(getattr(self, f.name)[idx] for f in fields(self)))


def _candidates(h: np.ndarray, slots: np.ndarray, owners: np.ndarray, total: np.ndarray | None = None) -> Candidates:
    """Every valid swap, spread and shed touching a slot of each rank in owners [K]: owner by owner, in
    _best_move's order within each kind. total [E]: each expert's copies, h.sum(0) when not given."""
    R, S = slots.shape
    E = h.shape[1]
    total = h.sum(0) if total is None else total
    flat = slots.ravel()
    parts = []
    for w in owners:
        i = np.repeat(np.arange(S), R * S)
        j = np.tile(np.arange(R * S), S)
        a, other, r2 = slots[w, i], flat[j], j // S
        none_, at_w = np.full(len(i), -1), np.full(len(i), w)
        i3 = np.repeat(np.arange(S), E)
        f = np.tile(np.arange(E), S)
        a3 = slots[w, i3]
        none3, at_w3 = np.full(len(i3), -1), np.full(len(i3), w)
        for kind, ii, jj, p, lp, gp, q, lq, gq, ok in (
            (0, i, j, a, at_w, r2, other, r2, at_w, (r2 != w) & (a != other)),
            (1, i, j, a, none_, r2, other, r2, none_, (r2 != w) & (a != other) & (total[other] >= 2)),
            (2, i3, f, a3, at_w3, none3, f, none3, at_w3, (a3 != f) & (total[a3] >= 2)),
        ):
            k = np.flatnonzero(ok)
            parts.append((np.full(len(k), w), np.full(len(k), kind), ii[k], jj[k], p[k], lp[k], gp[k], q[k], lq[k],
                          gq[k]))
    return Candidates(*(np.concatenate(col) for col in zip(*parts)))


def _bounded_move(dT, h, contrib, loads, slots, gpus, target, eps, batch: int = 0, state: ExpertState | None = None):
    """_best_move_touched's move (the same best score; between equal scores the first candidate), scoring
    exactly only the candidates that could still beat the best one found. A move removes at most the
    overload its touched ranks carry now, which with its local pairs (cheap, exact) bounds its score;
    candidates are scored exactly `batch` (default BATCH) at a time, highest bound first, until the best
    score found reaches the next bound. None when no candidate removes overload. state: ExpertState.of(dT,
    h.T) when the caller keeps one."""
    batch = batch or BATCH
    R, S = slots.shape
    w = int(np.argmax(loads))
    if state is None:
        state = ExpertState.of(dT, np.ascontiguousarray(h.T), gpus)
    c = _candidates(h, slots, np.array([w]), state.total)
    if len(c.owner) == 0:
        return None
    bound, gain_local = bounds(state, c, np.maximum(loads - target, 0.0), contrib)
    ceiling = _score(bound, gain_local, eps)
    order = np.argsort(-ceiling, kind="stable")
    order = order[np.isfinite(ceiling[order])]
    best, best_k = -np.inf, -1
    for start in range(0, len(order), batch):
        if ceiling[order[start]] < best:
            break
        chunk = np.sort(order[start : start + batch])
        sub = c.take(chunk)
        score = _score(*overload_change(state, loads, contrib, target, *sub.moves()), eps)
        k = int(np.argmax(score))
        if score[k] > best or (score[k] == best and chunk[k] < best_k):
            best, best_k = float(score[k]), int(chunk[k])
    if best_k < 0 or not np.isfinite(best):
        return None
    return _moves_of((best, KINDS[c.kind[best_k]], int(c.i[best_k]), int(c.j[best_k])), w, slots)


def bounds(state: ExpertState, c: Candidates, over: np.ndarray, contrib: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For candidates c: at least the overload each removes, and exactly the local pairs each gains, [B]
    each, from the overload [R] of every rank and each expert's load on it, contrib [E, R]. A rank's
    overload falls by at most its overload, and by at most what the experts putting less on it put there
    now; an expert puts less only on some ranks: one that only loses a copy puts more on every other rank
    (fewer copies share its load), so less only on the rank losing it; one that only gains a copy, on the
    ranks holding it; one that moves, on the rank losing it and on the ranks of the node it moves to, or on
    every rank holding it if that node held none (the node's demand stops being remote, which lowers every
    copy's share)."""
    R = len(over)
    E, N = state.x.shape
    G = R // N
    most = np.minimum(over[None, :], contrib)  # [E, R] the most expert e's change can remove on rank r
    most = np.concatenate([most, np.zeros((E, 1))], 1)  # column R: no rank
    on_holders = most.sum(1)  # [E]
    per_node = most[:, :R].reshape(E, N, G).sum(-1)  # [E, N]
    bound, gain_local = np.zeros(len(c.p)), np.zeros(len(c.p))
    for e, lose, get in ((c.p, c.lose_p, c.get_p), (c.q, c.lose_q, c.get_q)):
        ng = np.maximum(get, 0) // G
        at_lose, at_get = most[e, np.where(lose >= 0, lose, R)], most[e, np.where(get >= 0, get, R)]
        everywhere = (get >= 0) & ((lose < 0) | (state.x[e, ng] == 0))
        bound += np.where(get < 0, at_lose, np.where(everywhere, on_holders[e], at_lose + per_node[e, ng] + at_get))
        gain_local += state.remote[e] - state.remote_after(e, lose, get)
    return bound, gain_local


def _score(reduced: np.ndarray, gain_local: np.ndarray, eps: float) -> np.ndarray:
    """_better's score: overload removed per local share given up, -inf where nothing is removed."""
    score = reduced / (np.maximum(-gain_local, 0.0) + eps)
    score[reduced <= eps] = -np.inf
    return score


class _Half:
    """One expert per row losing a copy on rank `lose` and gaining one on rank `get` (-1: none): that
    expert's load on every rank afterwards, [B, R], and its local pairs before and after, [B]."""

    def __init__(self, dT, hT, local_now, gpus, pT, e, lose, get):
        B = len(e)
        rows = np.arange(B)
        he = hT[e]  # [B, R], a copy
        m = lose >= 0
        he[rows[m], lose[m]] -= 1
        m = get >= 0
        he[rows[m], get[m]] += 1
        self.loads = contributions(dT[e], he, gpus, None if pT is None else pT[e])
        self.local_new = local_pairs(dT[e], he, gpus)
        self.local_old = local_now[e]
