"""A Qwen3-MoE checkpoint (a dense layer among its MoE ones) served by expert-parallel ranks through a
live re-plan (2 ranks, a forced POST /ep/replan mid-stream) and through a lost rank (2x2, one SIGKILLed
mid-stream): every stream keeps one process's text, and the re-plan's bytes per epoch equal the replay's
(tests/server/ep_family_serving.py says how; test_deepseek_ep_serving.py runs the same on DeepSeek-V3)."""

from __future__ import annotations

import pytest

from tests.server.ep_family_serving import serve_and_lose_a_rank, serve_and_replan

pytestmark = pytest.mark.slow  # servers of 2 and 4 rank processes (--ep-ranks)


def test_a_forced_replan_mid_serve_on_qwen3_keeps_every_stream_and_the_bytes_replay(tmp_path):
    serve_and_replan("tiny-qwen3-moe", tmp_path)


def test_a_lost_rank_of_a_qwen3_server_loses_no_stream_and_no_token(tmp_path):
    serve_and_lose_a_rank("tiny-qwen3-moe", tmp_path)
