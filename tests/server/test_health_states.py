"""GET /health's states under expert parallelism, in one process (issue 41, scope 8): `recovering`
while survivors regroup (it used to say `error`), `degraded` once they serve on fewer ranks (it used
to say `ok`), and `error` with the engine's reason once it stopped (a placement disagreement, say).
The real processes behind each state: tests/server/test_elastic_serving.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

from locus.engine.ep.invariant import PlacementDisagreement
from locus.engine.ep.ranks.health import EPHealth
from locus.engine.frontend.health import EngineHealth
from locus.server.routes.health import health_of


def state(*, healthy=True, error=None, recovering=False, world=4, members=(0, 1, 2, 3), load_error=None,
          loaded=True):
    assert world == len(members)  # the ranks serving are the members
    health = EngineHealth(running=healthy, error=error, ep=EPHealth(started=4, serving=tuple(members),
                                                                   recovering=recovering, replanning=False))
    engine = SimpleNamespace(health=lambda: health) if loaded else None
    return SimpleNamespace(engine=engine, load_error=load_error)


def answer(response) -> tuple[int, dict, dict]:
    if isinstance(response, dict):
        return 200, response, {}
    return response.status_code, json.loads(response.body), dict(response.headers)


def test_every_rank_serving_is_ok():
    assert answer(health_of(state())) == (200, {"status": "ok"}, {})


def test_survivors_regrouping_are_recovering_not_error():
    code, body, headers = answer(health_of(state(recovering=True)))
    assert code == 503 and body["status"] == "recovering" and headers["retry-after"] == "2"


def test_serving_on_fewer_ranks_is_degraded_and_names_the_lost():
    code, body, _ = answer(health_of(state(world=3, members=(0, 1, 3))))
    assert code == 200 and body == {"status": "degraded", "detail": "serving on 3 of 4 expert-parallel ranks; lost: [2]"}


def test_a_stopped_engine_is_an_error_with_its_reason_never_ok():
    reason = PlacementDisagreement("the ranks disagree on the expert placement (rank(s) [1] hold weights that do not "
                                   "match); no rank may answer")
    code, body, _ = answer(health_of(state(healthy=False, error=reason, world=3, members=(0, 1, 3))))
    assert code == 503 and body["status"] == "error" and "disagree on the expert placement" in body["detail"]


def test_loading_and_a_failed_load():
    assert answer(health_of(state(loaded=False)))[:2] == (503, {"status": "loading", "detail": None})
    assert answer(health_of(state(loaded=False, load_error="no such model")))[:2] == (
        503, {"status": "error", "detail": "no such model"})


def test_every_state_is_one_the_openapi_document_lists():
    """/openapi.json's /health models (issue 44: the document describes what the server answers)."""
    from locus.server.openapi import Health, HealthUnavailable

    for s in (state(), state(recovering=True), state(world=3, members=(0, 1, 3)), state(loaded=False),
              state(loaded=False, load_error="no such model"), state(healthy=False, error=PlacementDisagreement("x"))):
        code, body, _ = answer(health_of(s))
        (Health if code == 200 else HealthUnavailable).model_validate(body)
