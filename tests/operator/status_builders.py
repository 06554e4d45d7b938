"""Builders shared by the status tests: a fixed clock and island pods as the operator observes them."""

import datetime

from diloco.operator.island_accounting import PodObservation

T0 = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def pod(
    ordinal,
    uid=None,
    *,
    island="a",
    restarts=0,
    phase="Running",
    ready=True,
    disrupted=False,
    terminating=False,
    node="node-1",
    revision="a-1",
    clean=False,
    exit=None,
    owner=None,
    lost=False,
    unschedulable=None,
    ready_since=None,
    token_hash=None,
):
    return PodObservation(
        name=f"job-{island}-{ordinal}",
        island=island,
        ordinal=ordinal,
        uid=uid or f"{island}-{ordinal}-u1",
        restarts=restarts,
        phase=phase,
        ready=ready and not terminating,
        terminating=terminating,
        disrupted=disrupted,
        node=node,
        revision=revision,
        ip=f"10.0.0.{ordinal + 1}",
        last_exit_clean=clean,
        last_exit=exit,
        owner=owner,
        lost_with_node=lost,
        unschedulable=unschedulable,
        ready_since=ready_since,
        token_hash=token_hash,
    )
