"""Island pods as observed, and what their comings and goings mean: failures (charged to the restart budget),
preemptions (never charged), and when an island must be re-formed. A container that exited with code 0
(a trainer that finished its steps, restarted by the kubelet) is neither.

Only what exists is observed; the island's status keeps a record of each pod as last seen, so a pod that
vanished between two passes is judged by what it was then and counted once, whatever the operator missed
while it was down. A pod is *preempted* when it carried the DisruptionTarget condition (preemption,
eviction, taint-based or node-shutdown eviction), its node is gone, NotReady or cordoned, or its containers
were lost with their node and restarted when it came back (a rebooted node, a datacenter back from an
outage: the kubelet found them gone from the runtime, LOST_WITH_NODE); any other loss, a container restart
or a pod in phase Failed is a *failure*. A pod whose StatefulSet is gone or was replaced
(deleted by hand, recreated by the operator with a new UID) went with it: neither, like a pod removed on purpose.

A multi-pod island is one torch.distributed world: when one rank dies the others fail with it. So every
failure or preemption *re-forms* the island (all its pods stopped, then started together, after
`backoffSeconds` for a failure), and the failures seen in one pass are charged once, as
`diloco.operator.policies.failure_policy.charged_failures` says. Only when every pod of the island was lost
with its node and restarted in place, seen on one pass, is the island not re-formed: its ranks all start
anew, as a re-form would start them.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diloco.api.conditions import Reason
from diloco.api.job import IslandSpec, IslandStatus, PodRecord, Reform
from diloco.operator import naming as n
from diloco.operator.events import Event
from diloco.operator.policies.failure_policy import charged_failures

_ORDINAL_SUFFIX = re.compile(r"-(\d+)$")
NAMED_CAUSES = 4
"""Failed pods whose end an IslandFailed Event describes; the others it counts."""
LOST_WITH_NODE = "ContainerStatusUnknown"
"""The reason of a container's last termination when the kubelet found it gone from the runtime while it was
running (its node rebooted): the kubelet restarts it and raises its restartCount, and no exit of the
trainer's caused it."""


@dataclass(frozen=True)
class PodObservation:
    """The facts about one island pod that accounting needs."""

    name: str
    island: str
    ordinal: int
    uid: str
    restarts: int
    phase: str
    ready: bool
    terminating: bool
    disrupted: bool
    node: str | None
    revision: str | None
    ip: str | None = None
    last_exit_clean: bool = False
    last_exit: str | None = None
    """How a container last terminated (`exit code 137 (OOMKilled)`), for the messages; None: never seen."""
    owner: str | None = None
    """UID of the StatefulSet that controls the pod (None: none does)."""
    lost_with_node: bool = False
    """Its containers' last end was their loss with their node (LOST_WITH_NODE)."""
    unschedulable: str | None = None
    """The scheduler's message while it cannot place the pod (PodScheduled False, reason Unschedulable)."""
    ready_since: datetime.datetime | None = None
    """When the pod last became Ready (its Ready condition's lastTransitionTime), while it is."""
    token_hash: str | None = None
    """The fingerprint of the token the pod was started with (its template's `diloco.dev/token-hash`)."""


@dataclass(frozen=True)
class NodeState:
    """A node as the accounting sees it; a missing node is a lost one."""

    exists: bool
    ready: bool = True
    schedulable: bool = True

    @property
    def healthy(self) -> bool:
        return self.exists and self.ready and self.schedulable


HEALTHY = NodeState(exists=True)


def _condition(conditions: Sequence[Mapping[str, Any]] | None, kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions or ())


def _unschedulable(conditions: Sequence[Mapping[str, Any]] | None) -> str | None:
    """The scheduler's message on a pod it cannot place, None for any other pod."""
    for c in conditions or ():
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return str(c.get("message") or "Unschedulable")
    return None


def _ready_since(conditions: Sequence[Mapping[str, Any]] | None) -> datetime.datetime | None:
    """When a Ready pod became so; None for a pod that is not Ready or whose condition has no time."""
    for c in conditions or ():
        if c.get("type") == "Ready" and c.get("status") == "True" and c.get("lastTransitionTime"):
            return datetime.datetime.fromisoformat(str(c["lastTransitionTime"]).replace("Z", "+00:00"))
    return None


def observe_pod(pod: Mapping[str, Any]) -> PodObservation | None:
    """From a Pod object (as the API returns it); None for a pod that is not an island pod."""
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    labels = meta.get("labels") or {}
    island = labels.get(n.LABEL_ISLAND)
    index = labels.get(n.POD_INDEX_LABEL)
    if index is None:
        match = _ORDINAL_SUFFIX.search(meta.get("name", ""))
        index = match.group(1) if match else None
    if island is None or index is None:
        return None
    terminating = meta.get("deletionTimestamp") is not None
    conditions = status.get("conditions")
    return PodObservation(
        name=meta["name"],
        island=island,
        ordinal=int(index),
        uid=meta["uid"],
        restarts=sum(int(c.get("restartCount", 0)) for c in status.get("containerStatuses") or ()),
        phase=status.get("phase", "Pending"),
        ready=_condition(conditions, "Ready") and not terminating,
        terminating=terminating,
        disrupted=_condition(conditions, "DisruptionTarget"),
        node=(pod.get("spec") or {}).get("nodeName"),
        revision=labels.get(n.REVISION_LABEL),
        ip=status.get("podIP"),
        last_exit_clean=_last_exit_clean(status.get("containerStatuses") or ()),
        last_exit=_last_exit(status.get("containerStatuses") or ()),
        owner=next(
            (
                ref.get("uid")
                for ref in meta.get("ownerReferences") or ()
                if ref.get("kind") == "StatefulSet" and ref.get("controller")
            ),
            None,
        ),
        lost_with_node=_lost_with_node(status.get("containerStatuses") or ()),
        unschedulable=_unschedulable(conditions),
        ready_since=_ready_since(conditions) if not terminating else None,
        token_hash=(meta.get("annotations") or {}).get(n.ANNOTATION_TOKEN_HASH),
    )


def _lost_with_node(statuses: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a container last ended lost with its node (LOST_WITH_NODE)."""
    return any(((s.get("lastState") or {}).get("terminated") or {}).get("reason") == LOST_WITH_NODE for s in statuses)


def _last_exit_clean(statuses: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every container that has terminated before last did so with exit code 0: a trainer that
    finished its steps and was restarted by the kubelet, not a failure."""
    exits = [((s.get("lastState") or {}).get("terminated") or {}).get("exitCode") for s in statuses]
    exits = [code for code in exits if code is not None]
    return bool(exits) and all(code == 0 for code in exits)


def _last_exit(statuses: Sequence[Mapping[str, Any]]) -> str | None:
    """The latest termination of any container, current or last, in words; None when none terminated."""
    ends = [
        term
        for s in statuses
        for term in (((s.get("state") or {}).get("terminated")), ((s.get("lastState") or {}).get("terminated")))
        if term and term.get("exitCode") is not None
    ]
    if not ends:
        return None
    last = max(ends, key=lambda t: str(t.get("finishedAt") or ""))
    reason = last.get("reason")
    return f"exit code {last['exitCode']}" + (f" ({reason})" if reason else "")


def observe_node(node: Mapping[str, Any] | None) -> NodeState:
    """From a Node object, or None when the API says it does not exist."""
    if node is None:
        return NodeState(exists=False)
    return NodeState(
        exists=True,
        ready=_condition((node.get("status") or {}).get("conditions"), "Ready"),
        schedulable=not (node.get("spec") or {}).get("unschedulable", False),
    )


def nodes_to_check(previous: Sequence[PodRecord], pods: Sequence[PodObservation]) -> set[str]:
    """Nodes whose state decides how a loss is counted: those of vanished or replaced pods not already
    explained, and those of failed pods. Looked up only when needed, never listed."""
    live = {(p.ordinal, p.uid) for p in pods}
    names = {r.node for r in previous if (r.ordinal, r.uid) not in live and r.node and not r.failed and not r.disrupted}
    names |= {p.node for p in pods if p.phase == "Failed" and not p.disrupted and p.node}
    return names


@dataclass(frozen=True)
class IslandAccount:
    """The island's new status, the replicas its StatefulSet should have now, what to tell the user, and the
    failure charged on this pass in words (None: none was)."""

    status: IslandStatus
    replicas: int
    events: tuple[Event, ...]
    failure: str | None = None


@dataclass
class _PodLosses:
    """The island's pods lost on one pass, by ordinal: failures (counted per pod, with the last cause seen)
    and preemptions."""

    failures: dict[int, int] = field(default_factory=dict)
    causes: dict[int, str] = field(default_factory=dict)
    preempted: list[int] = field(default_factory=list)
    came_back: list[int] = field(default_factory=list)
    """Of the preempted, those lost with their node and restarted in place when it came back."""

    def restarted_together(self, replicas: int) -> bool:
        """Every one of the island's `replicas` pods came back, and nothing else was lost."""
        return sorted(self.preempted) == sorted(self.came_back) == list(range(replicas))

    def fail(self, ordinal: int, cause: str, count: int = 1) -> None:
        self.failures[ordinal] = self.failures.get(ordinal, 0) + count
        self.causes[ordinal] = cause

    def described(self, most: int) -> str:
        """How each failed pod ended, pod by pod, at most `most` of them (an Event stays short)."""
        causes = [self.causes[ordinal] for ordinal in sorted(self.failures)]
        more = f"; and {len(causes) - most} more pods failed" if len(causes) > most else ""
        return "; ".join(causes[:most]) + more

    def charged_cause(self) -> str | None:
        """The cause of the most failures of any one pod (the one charged), None when none failed."""
        if not self.failures or self.preempted:
            return None
        return self.causes[max(self.failures, key=lambda ordinal: (self.failures[ordinal], -ordinal))]


@dataclass(frozen=True)
class _Judge:
    """How one pass judges the island's lost pods."""

    previous: IslandStatus
    replicas: int
    nodes: Mapping[str, NodeState]
    active: bool
    workload: str | None

    def removed_on_purpose(self, ordinal: int, owner: str | None) -> bool:
        """The island is wound down or re-forming, was scaled below this pod, or the pod's StatefulSet (`owner`)
        is no longer the island's (deleted, or recreated with a new UID): its loss is no one's fault."""
        return (
            not self.active
            or (owner is not None and owner != self.workload)
            or self.previous.reform is not None
            or ordinal >= self.previous.desired
            or ordinal >= self.replicas
        )

    def count(self, losses: _PodLosses, ordinal: int, disrupted: bool, node: str | None, cause: str) -> None:
        """A lost pod is preempted when it was disrupted or its node is lost, else it failed (of `cause`)."""
        if disrupted or not self.nodes.get(node or "", HEALTHY).healthy:
            losses.preempted.append(ordinal)
        else:
            losses.fail(ordinal, cause)


def _count_vanished_pods(
    judge: _Judge, records: Mapping[int, PodRecord], pods: Mapping[int, PodObservation], losses: _PodLosses
) -> None:
    """Recorded pods that are gone or replaced, judged by what they were when last seen, unless their loss
    was already counted (they were seen Failed) or was expected."""
    for ordinal, record in records.items():
        pod = pods.get(ordinal)
        if (
            (pod is not None and pod.uid == record.uid)
            or record.failed
            or judge.removed_on_purpose(ordinal, record.owner)
        ):
            continue
        judge.count(losses, ordinal, record.disrupted, record.node, f"pod {ordinal} vanished")


def _count_live_pods(
    judge: _Judge,
    records: Mapping[int, PodRecord],
    pods: Mapping[int, PodObservation],
    first_sight: bool,
    losses: _PodLosses,
) -> None:
    """Pods seen in phase Failed for the first time, and container restarts since the last pass (a clean
    exit excepted; on first sight of the island, its history is not charged; containers lost with their node
    and restarted when it came back are a preemption)."""
    for ordinal, pod in sorted(pods.items()):
        if judge.removed_on_purpose(ordinal, pod.owner):
            continue
        record = records.get(ordinal)
        same = record is not None and record.uid == pod.uid
        seen_restarts = record.restarts if record is not None and same else (pod.restarts if first_sight else 0)
        already_failed = record is not None and same and record.failed
        how = f", {pod.last_exit}" if pod.last_exit else ""
        if pod.phase == "Failed" and not already_failed:
            judge.count(losses, ordinal, pod.disrupted, pod.node, f"pod {pod.name} failed{how}")
        restarted = pod.restarts - seen_restarts - (1 if pod.last_exit_clean else 0)
        if restarted > 0 and not pod.disrupted:
            if pod.lost_with_node:
                losses.preempted.append(ordinal)
                losses.came_back.append(ordinal)
            else:
                losses.fail(ordinal, f"pod {pod.name} restarted{how}", restarted)


def _pod_records(records: Mapping[int, PodRecord], pods: Mapping[int, PodObservation]) -> list[PodRecord]:
    """The record of each pod as seen now; a pod once disrupted stays marked so."""
    new_records: list[PodRecord] = []
    for ordinal, pod in sorted(pods.items()):
        record = records.get(ordinal)
        was_disrupted = record is not None and record.uid == pod.uid and record.disrupted
        new_records.append(
            PodRecord(
                ordinal=ordinal,
                uid=pod.uid,
                restarts=pod.restarts,
                node=pod.node,
                disrupted=pod.disrupted or was_disrupted,
                failed=pod.phase == "Failed",
                owner=pod.owner,
            )
        )
    return new_records


def outdated(pods: Sequence[PodObservation], update_revision: str | None) -> bool:
    """Some pod runs another template revision than the StatefulSet's current one."""
    return bool(update_revision) and any(p.revision and p.revision != update_revision for p in pods)


def _begin_reform(
    name: str,
    losses: _PodLosses,
    restarts: int,
    charged: int,
    outdated: bool,
    backoff_seconds: int,
    now: datetime.datetime,
) -> tuple[Reform, Event] | None:
    """Why the island must re-form now, and the Event that says so; None when it need not. A preemption
    re-forms it at once and uncharged, a charged failure after the backoff, a new pod template at once."""
    if losses.preempted:
        return Reform(reason="Preemption", since=now, hold_until=now), Event(
            "Warning",
            Reason.ISLAND_PREEMPTED,
            f"island {name}: pods {sorted(losses.preempted)} preempted or lost with their node; "
            "re-forming the island (not counted against the restart budget)",
        )
    if charged:
        hold = now + datetime.timedelta(seconds=backoff_seconds)
        return Reform(reason="Failure", since=now, hold_until=hold), Event(
            "Warning",
            Reason.ISLAND_FAILED,
            f"island {name}: {losses.described(NAMED_CAUSES)}; restarts {restarts}; "
            f"re-forming after {backoff_seconds}s",
        )
    if outdated:
        return Reform(reason="Update", since=now, hold_until=now), Event(
            "Normal", Reason.ISLAND_UPDATING, f"island {name}: pod template changed; re-forming the island"
        )
    return None


def account_island(
    previous: IslandStatus | None,
    island: IslandSpec,
    pods: Sequence[PodObservation],
    nodes: Mapping[str, NodeState],
    update_revision: str | None,
    active: bool,
    backoff_seconds: int,
    now: datetime.datetime,
    workload: str | None = None,
    *,
    may_update: bool = True,
) -> IslandAccount:
    """Folds one observation of the island's pods into its status (see the module docstring).

    `update_revision` is the StatefulSet's current template revision when the controller has observed
    the latest spec (else None); pods of another revision make the island re-form to pick it up, once the
    rolling update lets it (`may_update`, see `policies.rolling_update`).
    `active` is false while the job is suspended or finished: the island is then wound down to zero.
    `workload` is the UID of the island's StatefulSet now (None: it does not exist)."""
    prev = previous or IslandStatus(name=island.name)
    records = {r.ordinal: r for r in prev.pods}
    current = {p.ordinal: p for p in pods}

    judge = _Judge(previous=prev, replicas=island.replicas, nodes=nodes, active=active, workload=workload)
    losses = _PodLosses()
    _count_vanished_pods(judge, records, current, losses)
    _count_live_pods(judge, records, current, previous is None, losses)
    charged = charged_failures(losses.failures, preempted=bool(losses.preempted))

    events: list[Event] = []
    reform = prev.reform if active else None
    rolled_at = prev.rolled_at if active else None
    if active and reform is None and losses.restarted_together(island.replicas):
        events.append(
            Event(
                "Warning",
                Reason.ISLAND_PREEMPTED,
                f"island {island.name}: pods {sorted(losses.came_back)} lost with their node and restarted when it "
                "came back; not re-formed (not counted against the restart budget)",
            )
        )
    elif active and reform is None:
        stale = may_update and outdated(pods, update_revision)
        begun = _begin_reform(island.name, losses, prev.restarts + charged, charged, stale, backoff_seconds, now)
        if begun is not None:
            reform, event = begun
            events.append(event)
    if reform is not None and not pods and now >= reform.hold_until:
        events.append(Event("Normal", Reason.ISLAND_REFORMED, f"island {island.name}: starting {island.replicas} pods"))
        if reform.reason == "Update":
            rolled_at = now
        reform = None

    desired = island.replicas if active else 0
    status = prev.model_copy(
        update={
            "desired": desired,
            "ready": sum(1 for p in pods if p.ready),
            "restarts": prev.restarts + charged,
            "preemptions": prev.preemptions + len(losses.preempted),
            "reform": reform,
            "rolled_at": rolled_at,
            "pods": _pod_records(records, current),
        }
    )
    return IslandAccount(
        status=status,
        replicas=0 if reform is not None else desired,
        events=tuple(events),
        failure=losses.charged_cause() if charged else None,
    )
