"""How well a predicted node cost ranks the nodes for a request: predicted against measured.

`measured` [R, N] is what each request's decode really cost per token on each node: the cost model
(node_cost.py) on its decode pair counts with no prior, exact for top-1 routing and the model's own
approximation for top-k. `predicted` [R, N] is what a predictor said before (or right after) prefill.
Only the ranking of nodes matters to the grouper, so the figures are about choosing the node:

    agreement   share of requests whose predicted cheapest node is the measured cheapest (ties: any)
    regret      mean over requests of measured[predicted cheapest] - measured[cheapest], bytes/token
    blind       the same regret for a node picked at random (the mean over nodes): what no
                prediction costs
    captured    1 - regret / blind: the share of the avoidable bytes the prediction avoids
    correlation Pearson correlation of predicted and measured costs, each request's mean over nodes
                removed (how well the differences between nodes are predicted)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class NodeCostAccuracy:
    requests: int
    agreement: float
    regret: float
    blind: float
    captured: float
    correlation: float

    def to_dict(self) -> dict:
        return asdict(self)


def node_cost_accuracy(predicted: np.ndarray, measured: np.ndarray) -> NodeCostAccuracy:
    predicted, measured = np.asarray(predicted, np.float64), np.asarray(measured, np.float64)
    if predicted.shape != measured.shape or predicted.ndim != 2:
        raise ValueError(f"predicted {predicted.shape} and measured {measured.shape} must both be [requests, nodes]")
    R = len(measured)
    if R == 0:
        return NodeCostAccuracy(0, float("nan"), float("nan"), float("nan"), float("nan"), float("nan"))
    best = measured.min(1)
    chosen = measured[np.arange(R), np.argmin(predicted, 1)]
    agreement = float(np.mean(np.isclose(chosen, best)))
    regret = float(np.mean(chosen - best))
    blind = float(np.mean(measured.mean(1) - best))
    p = predicted - predicted.mean(1, keepdims=True)
    m = measured - measured.mean(1, keepdims=True)
    denom = float(np.sqrt((p * p).sum() * (m * m).sum()))
    correlation = float((p * m).sum() / denom) if denom > 0 else float("nan")
    captured = 1.0 - regret / blind if blind > 0 else float("nan")
    return NodeCostAccuracy(R, agreement, regret, blind, captured, correlation)
