"""Requests a client sends together leave the router together (Relay.after_arrivals): a request ready to
go yields a few turns of the event loop, and more while another request is still in intake, so that an
idle engine behind it gets the whole wave within its burst wait instead of the first request alone."""

import asyncio

from locus.router.relay import WAVE_TURNS, WAVE_TURNS_MAX, Relay


def relay() -> Relay:
    return Relay(pool=None, admissions=None, metrics=None)  # after_arrivals reads only the intake count


async def turns_taken(r: Relay, intake_turns: int | None) -> tuple[int, list[str]]:
    """Run after_arrivals beside a request in intake for `intake_turns` turns (None: no such request);
    return how many turns it took and the order the two finished in."""
    order, turns = [], 0
    if intake_turns is not None:
        r.arriving += 1

    async def intake():
        for _ in range(intake_turns):
            await asyncio.sleep(0)
        r.arriving -= 1
        order.append("intake done")

    async def ready():
        nonlocal turns
        task = asyncio.ensure_future(r.after_arrivals())
        while not task.done():
            await asyncio.sleep(0)
            turns += 1
        order.append("sent")

    await asyncio.gather(ready(), *([intake()] if intake_turns is not None else []))
    return turns, order


def test_a_lone_request_waits_only_the_few_turns():
    turns, order = asyncio.run(turns_taken(relay(), None))
    assert order == ["sent"]
    assert WAVE_TURNS <= turns <= WAVE_TURNS + 1


def test_a_ready_request_waits_for_one_still_in_intake():
    turns, order = asyncio.run(turns_taken(relay(), WAVE_TURNS + 3))
    assert order == ["intake done", "sent"]
    assert turns > WAVE_TURNS + 3


def test_the_wait_is_bounded_when_an_intake_never_ends():
    turns, order = asyncio.run(turns_taken(relay(), 10 * WAVE_TURNS_MAX))
    assert order == ["sent", "intake done"]
    assert turns <= WAVE_TURNS_MAX + 1
