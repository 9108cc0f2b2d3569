"""The 2-CTA backward's dQ hand-off as a state machine, every interleaving explored.

kernels/sm90/bwd_split.py and bwd.py (BwdSm90.dq_writer, _dq_full) sync one consumer
warpgroup with its writer warp per walk step, with no timing assumptions to lean on:

- the producer loads step j's Q into ring slot j % stages once the writer has freed
  step j - stages there;
- the consumer (4 warps) waits for step j's Q, then hands step j - 1's dQ sum over by
  arriving on a named barrier; after the last step it hands that step's over at once;
- the writer warp, per step: waits for its deterministic turn (before or after the
  hand-off), waits on the step's barrier, then adds and frees the Q slot.

A named barrier counts warps and completes a round at its count (5: four consumer
warps and the writer), whoever arrived; arrivals past it start the next round. So two
hand-offs on one barrier before the writer's wait there complete a round without the
writer, which then waits on a round that never completes. These tests hold the
kernel's protocol (two barriers taken by the step's parity, two Q stages) free of
that in every order of events, and show the checker finds it where it exists. The
other consumer and the peer CTA only delay these events, and every delay is already
among the orders explored.
"""

import pytest

CONSUMER_WARPS = 4
BARRIER_COUNT = CONSUMER_WARPS + 1


def explore(steps: int, stages: int, barriers: int, turn_first: bool):
    """Every state reachable by one consumer, its writer and the producer; returns the
    states in which nothing can move before all three are done (deadlocks)."""
    # state: (loaded, consumer, handed, writer, phase, freed, turns,
    #         rounds (count, generation) per barrier, writer's awaited generation)
    start = (0, 0, 0, 0, 0, 0, 0, ((0, 0),) * barriers, -1)
    seen, frontier, stuck = {start}, [start], []
    while frontier:
        state = frontier.pop()
        nxt = list(_moves(state, steps, stages, barriers, turn_first))
        if not nxt and state[3] < steps:
            stuck.append(state)
        for s in nxt:
            if s not in seen:
                seen.add(s)
                frontier.append(s)
    return stuck


def _arrive(rounds, b, warps):
    """`warps` arrivals on barrier b, one warp at a time."""
    count, gen = rounds[b]
    for _ in range(warps):
        count += 1
        if count == BARRIER_COUNT:
            count, gen = 0, gen + 1
    return rounds[:b] + ((count, gen),) + rounds[b + 1:]


def _moves(state, steps, stages, barriers, turn_first):
    loaded, consumer, handed, writer, phase, freed, turns, rounds, awaited = state
    # producer: Q of step `loaded` into a slot the writer freed
    if loaded < steps and loaded - stages < freed:
        yield (loaded + 1, consumer, handed, writer, phase, freed, turns, rounds, awaited)
    # the other pairs: the turn of the next step may come at any time
    if turns < steps:
        yield (loaded, consumer, handed, writer, phase, freed, turns + 1, rounds, awaited)
    # consumer: step `consumer` once loaded; in step j it hands over step j - 1, and
    # after the last step that step's without waiting for anything
    if handed < (steps if consumer == steps else consumer - 1):
        r = _arrive(rounds, handed % barriers, CONSUMER_WARPS)
        yield (loaded, consumer, handed + 1, writer, phase, freed, turns, r, awaited)
    elif consumer < steps and consumer < loaded:
        yield (loaded, consumer + 1, handed, writer, phase, freed, turns, rounds, awaited)
    # writer, step `writer`: phase 0 waits for the turn or arrives, 1 waits for the
    # round, 2 waits for the turn if it comes second, 3 adds and frees the slot
    if writer < steps:
        b = writer % barriers
        if phase == 0 and (not turn_first or turns > writer):
            r = _arrive(rounds, b, 1)
            done = r[b][1] > rounds[b][1]
            yield (loaded, consumer, handed, writer, 2 if done else 1, freed, turns, r,
                   rounds[b][1])
        elif phase == 1 and rounds[b][1] > awaited:
            yield (loaded, consumer, handed, writer, 2, freed, turns, rounds, awaited)
        elif phase == 2 and (turn_first or turns > writer):
            yield (loaded, consumer, handed, writer, 3, freed, turns, rounds, awaited)
        elif phase == 3:
            yield (loaded, consumer, handed, writer + 1, 0, freed + 1, turns, rounds, -1)


@pytest.mark.parametrize("steps,turn_first", [(n, t) for n in (1, 2, 3, 5, 8) for t in (False, True)])
def test_kernel_protocol_never_deadlocks(steps, turn_first):
    assert explore(steps, stages=2, barriers=2, turn_first=turn_first) == []


@pytest.mark.parametrize("turn_first", (False, True))
def test_one_barrier_can_deadlock(turn_first):
    # The order the kernel had before the parity barriers: the last two hand-offs can
    # both come before the writer's wait for the first of them.
    assert explore(5, stages=2, barriers=1, turn_first=turn_first) != []


def test_three_stages_need_more_barriers():
    # kernels/config.py BwdTile: pairs keep two Q stages.
    assert explore(5, stages=3, barriers=2, turn_first=True) != []
