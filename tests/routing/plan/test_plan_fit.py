"""A plan is checked once (issue 58, item 3): `load_plan` checks the file, and where a loaded plan meets a
model only its fit is checked (`check_fit`), with the messages `validate` gives for the same faults."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from locus.routing.plan.placement import PlanError, check_fit, validate
from locus.routing.plan.topology import Topology
from locus.routing.planners.baselines import round_robin

PLAN = round_robin(8, [1, 3], Topology(1, 2, 4))


@pytest.mark.parametrize("experts, layers, message", [
    (16, [1, 3], "plan is for 8 experts, the model has 16"),
    (8, [1, 3, 5], "plan has no placement for MoE layer 5"),
    (8, [1], "plan places layer 3, which is not an MoE layer of the model [1]"),
])
def test_check_fit_refuses_what_validate_refuses_for_the_model(experts, layers, message):
    for check in (check_fit, validate):
        with pytest.raises(PlanError) as info:
            check(PLAN, experts, layers)
        assert str(info.value) == message
    check_fit(PLAN, 8, [3, 1])


def test_check_fit_leaves_the_plan_itself_to_its_loader():
    slots = np.array(PLAN.slots)
    slots[0, 0, 0] = 99  # an expert id no model has: load_plan (validate) refuses the file
    broken = dataclasses.replace(PLAN, slots=slots)
    with pytest.raises(PlanError, match="expert id 99 is outside 0..7"):
        validate(broken, 8, [1, 3])
    check_fit(broken, 8, [1, 3])  # the fit alone: the plan's own rules were checked once, when it was loaded
