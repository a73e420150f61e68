"""The router is light: building it and admitting a request imports neither the engine nor torch
(it talks to engines over HTTP; docs/design.md, "Layout and layering")."""

import subprocess
import sys

import pytest

from tests.router.route_fixtures import MINI

SCRIPT = f"""
import sys
import numpy as np
from locus.routing.plan.caps import Caps
from locus.routing.plan.grouping_spec import GroupingSpec
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology
from locus.router.app import build_app
from locus.router.admission import Admissions, RoutedRequest
from locus.router.prompts import PromptTokenizer
from locus.routing.grouping.live import live_grouper

spec = GroupingSpec(domain_nodes={{"code": [1.0, 0.0]}}, caps=Caps(), expected_decode_tokens=10.0, kv_bytes_per_token=1,
                    bytes_per_send=1, top_k=1, expert_prior=np.full((1, 4), 0.25))
slots = np.array([[[0, 0], [1, 1], [2, 2], [3, 3]]])
plan = PlacementPlan("toy", 4, (0,), Topology(2, 2, 2), slots, grouping=spec.to_dict())
admissions = Admissions(live_grouper(plan), 2048)
ids = PromptTokenizer.load({str(MINI)!r}).completion_prompts("def f(): pass")
print(admissions.admit(RoutedRequest("a", "code", ids, 1, 8)).rank)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("locus.engine") or m.startswith("locus.server")))
"""


@pytest.mark.slow  # a fresh interpreter
def test_routing_a_request_imports_no_engine_and_no_torch():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["0", "[]"]
