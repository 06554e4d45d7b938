"""One reconcile pass of one job: observe the cluster, decide (pure, `job_status.decide`), render the children
(pure, `children.render_children`) and converge: apply what differs, delete what is no longer wanted.

Level-based: nothing here depends on which event triggered the pass or on anything remembered between
passes except the job's own status; running a pass twice does no more than running it once (an object is
applied only when it is missing, was rendered differently, or was changed by someone else).
"""

from __future__ import annotations

import datetime
import logging
import typing
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from diloco.api.conditions import Reason
from diloco.api.job import DiLoCoJobSpec, DiLoCoJobStatus
from diloco.operator import naming as n
from diloco.operator.children import OperatorRef, child_key, render_children
from diloco.operator.drift import in_sync
from diloco.operator.event_recorder import EventRecorder
from diloco.operator.events import Event
from diloco.operator.exposure import endpoints, external_hosts, shard_targets
from diloco.operator.island_accounting import PodObservation, nodes_to_check, observe_node, observe_pod
from diloco.operator.job_status import Observation, ShardObservation, decide
from diloco.operator.job_tls import JobTls, job_tls
from diloco.operator.kube import ApiError, Kube
from diloco.operator.policies.island_training import TrainerReport
from diloco.operator.policies.rolling_update import shards_held_back
from diloco.operator.policies.token_rotation import rotation_step
from diloco.operator.probes import shard_statuses, trainer_reports
from diloco.operator.tokens import JobTokens, ca_key, fingerprint, job_token
from diloco.transport.tls import Security

log = logging.getLogger("diloco.operator")

PARALLEL_CALLS = 8
"""Applies and deletes in flight at once within a pass (the API client's connection pool holds as many)."""
WORKLOADS = ("Deployment", "StatefulSet", "Job")
CHILD_KINDS = (
    "ConfigMap",
    "Secret",
    "NetworkPolicy",
    "PersistentVolumeClaim",
    "Service",
    "Deployment",
    "StatefulSet",
    "Job",
    "GRPCRoute",
)
"""A cluster without the Gateway API lists no GRPCRoute (`Kube.list` answers a missing kind with none)."""

ShardPoller = Callable[[Sequence[str], Sequence[bool], Sequence[str], Security, float], list[ShardObservation]]
TrainerScraper = Callable[[Mapping[str, str], float], dict[str, TrainerReport]]


@dataclass(frozen=True)
class PassOutcome:
    """What a pass did: the status to write (None: leave it as it is), events to post, objects applied and
    deleted."""

    status: dict[str, Any] | None
    events: tuple[Event, ...]
    applied: tuple[str, ...]
    deleted: tuple[str, ...]
    job_deleted: bool


LEFT_ALONE = PassOutcome(status=None, events=(), applied=(), deleted=(), job_deleted=False)
"""A pass that did nothing: the job's namespace is being deleted."""


def terminating(namespace: Mapping[str, Any] | None) -> bool:
    """Whether a Namespace is being deleted: the namespace controller is removing everything in it, the job's
    pods among them, and the API server refuses anything new there (an Event: 403)."""
    meta, status = (namespace or {}).get("metadata") or {}, (namespace or {}).get("status") or {}
    return bool(meta.get("deletionTimestamp")) or status.get("phase") == "Terminating"


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (`Model` or `Model | None`), None for any other field."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _with_nulls(body: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """`body` with `null` for every field of `model` it lacks, in nested objects too (lists are replaced
    whole by a merge patch, so their items need none)."""
    for name, info in model.model_fields.items():
        value = body.setdefault(info.alias or name, None)
        nested = _nested_model(info.annotation)
        if isinstance(value, dict) and nested is not None:
            _with_nulls(value, nested)
    return body


def status_patch(status: DiLoCoJobStatus) -> dict[str, Any]:
    """The status as a JSON merge patch: every field present, at every level, `null` clearing those unset
    (a merge patch keeps a nested field it does not name: status.export.message once the export succeeded)."""
    return _with_nulls(status.model_dump(mode="json", by_alias=True, exclude_none=True), DiLoCoJobStatus)


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller") for ref in obj["metadata"].get("ownerReferences", ()))


def foreign_controller(obj: Mapping[str, Any], uid: str) -> str | None:
    """`Kind/name` of the object's controller when that is not the job `uid`: such an object is never applied
    over (another job's child, or one someone else manages, that happens to hold the name)."""
    for ref in obj["metadata"].get("ownerReferences", ()):
        if ref.get("controller") and ref.get("uid") != uid:
            return f"{ref.get('kind')}/{ref.get('name')}"
    return None


def summarize(keys: Sequence[str], limit: int = 8) -> str:
    """`kind/name` keys for an Event's message, the first `limit` of them named and the rest counted."""
    named = ", ".join(keys[:limit])
    return named if len(keys) <= limit else f"{named} and {len(keys) - limit} more"


def _metrics_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


def _shard_services(
    job: n.JobRef, spec: DiLoCoJobSpec, existing: Mapping[tuple[str, str], Mapping[str, Any]]
) -> dict[int, Mapping[str, Any] | None]:
    """Each shard's live Service, by shard (None where there is none yet)."""
    return {s: existing.get(("Service", n.syncer_name(job.name, s))) for s in range(spec.syncer.shards)}


class Reconciler:
    """Holds the API client and the probes; `reconcile` is one pass over one job."""

    def __init__(
        self,
        kube: Kube,
        operator: OperatorRef | None,
        probe_timeout: float = 2.0,
        poll_shards: ShardPoller = shard_statuses,
        scrape_trainers: TrainerScraper = trainer_reports,
        parallel_calls: int = PARALLEL_CALLS,
        *,
        token_key: bytes,
    ) -> None:
        """`token_key`: the operator's key every job's token derives from (`kube.load_token_key`)."""
        self.kube = kube
        self.events = EventRecorder(kube)
        self.token_key = token_key
        self.parallel_calls = parallel_calls
        self.operator = operator
        self.probe_timeout = probe_timeout
        self.poll_shards = poll_shards
        self.scrape_trainers = scrape_trainers

    def _each(self, call: Callable[[Any], object], items: Sequence[Any]) -> list[ApiError | None]:
        """`call` on every item, up to `parallel_calls` at once: each is one API round trip, so a pass over
        hundreds of islands costs their latency divided by the parallelism. The refusal of each, or None."""

        def attempt(item: Any) -> ApiError | None:
            try:
                call(item)
            except ApiError as error:
                return error
            return None

        if len(items) <= 1 or self.parallel_calls <= 1:
            return [attempt(item) for item in items]
        with ThreadPoolExecutor(max_workers=min(self.parallel_calls, len(items))) as pool:
            return list(pool.map(attempt, items))

    def _list(self, job: n.JobRef) -> tuple[dict[tuple[str, str], dict[str, Any]], list[dict[str, Any]]]:
        """The job's children by key, and its pods: one list call per kind, all in flight at once (a pass
        over a running job is these calls and nothing else, so their latency is most of its duration)."""
        kinds = (*CHILD_KINDS, "Pod")
        with ThreadPoolExecutor(max_workers=max(1, min(self.parallel_calls, len(kinds)))) as pool:
            listed = dict(
                zip(kinds, pool.map(lambda kind: self.kube.list(kind, job.namespace, n.job_selector(job.name)), kinds))
            )
        pods = listed.pop("Pod")
        return {child_key(obj): obj for found in listed.values() for obj in found}, pods

    def _unlisted(self, job: n.JobRef, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
        """The objects that hold the names of children missing from the job's lists (another job's, or
        someone else's, without the job's label): one get per name, only while a child is to be created."""
        if not keys:
            return {}
        with ThreadPoolExecutor(max_workers=max(1, min(self.parallel_calls, len(keys)))) as pool:
            found = pool.map(lambda key: self.kube.get(key[0], job.namespace, key[1]), keys)
        return {key: obj for key, obj in zip(keys, found) if obj is not None}

    def _observe(
        self,
        job: n.JobRef,
        spec: DiLoCoJobSpec,
        previous: DiLoCoJobStatus,
        existing: Mapping[tuple[str, str], Mapping[str, Any]],
        raw_pods: Sequence[Mapping[str, Any]],
        tokens: Sequence[str],
        probe: Security | str,
    ) -> Observation:
        """What exists and what the job's processes say; `tokens`: those to call the shards with, in order (the
        one the islands present, then, during a rotation, the job's new one)."""
        pods: dict[str, list[PodObservation]] = {island.name: [] for island in spec.islands}
        for raw in raw_pods:
            pod = observe_pod(raw)
            if pod is not None and pod.island in pods:
                pods[pod.island].append(pod)

        records = {i.name: i.pods for i in previous.islands}
        wanted = set().union(*(nodes_to_check(records.get(name, []), found) for name, found in pods.items()))
        nodes = {name: observe_node(self.kube.get("Node", None, name)) for name in sorted(wanted)}

        revisions: dict[str, str] = {}
        workloads: dict[str, str] = {}
        for island in spec.islands:
            sts = existing.get(("StatefulSet", n.island_name(job.name, island.name)))
            if sts is not None:
                workloads[island.name] = sts["metadata"].get("uid", "")
            status = (sts or {}).get("status") or {}
            if (
                sts
                and status.get("updateRevision")
                and status.get("observedGeneration") == sts["metadata"].get("generation")
            ):
                revisions[island.name] = status["updateRevision"]

        ready = [
            int(
                ((existing.get(("Deployment", n.syncer_name(job.name, shard))) or {}).get("status") or {}).get(
                    "readyReplicas", 0
                )
            )
            > 0
            for shard in range(spec.syncer.shards)
        ]
        if spec.remote_syncers is not None:  # another cluster's shards: called whenever, ready when they answer
            ready = [True] * spec.syncer.shards
        if isinstance(probe, str):  # the job's TLS Secrets are not there: nothing to call the shards with
            shards = [ShardObservation(shard=s, ready=r, error=f"UNAVAILABLE: {probe}") for s, r in enumerate(ready)]
        else:
            shards = self.poll_shards(shard_targets(job, spec), ready, tokens, probe, self.probe_timeout)
        if spec.remote_syncers is not None:
            shards = [replace(s, ready=s.fragments is not None) for s in shards]

        # Rank 0 of each island with a running pod, ready or not: a trainer whose calls are refused never gets
        # ready, and says so.
        urls = {
            name: _metrics_url(pod.ip, spec.trainer.metrics_port)
            for name, found in pods.items()
            for pod in found
            if pod.ordinal == 0 and pod.phase == "Running" and not pod.terminating and pod.ip
        }
        trainers = self.scrape_trainers(urls, self.probe_timeout)
        shard_pods = sum(
            1 for raw in raw_pods if raw["metadata"].get("labels", {}).get(n.LABEL_COMPONENT) == n.COMPONENT_SYNCER
        )
        return Observation(
            pods=pods,
            nodes=nodes,
            update_revisions=revisions,
            shards=shards,
            trainers=trainers,
            workloads=workloads,
            shard_pods=shard_pods,
            export_job=existing.get(("Job", n.export_job_name(job.name))),
            endpoints=endpoints(job.name, spec, _shard_services(job, spec, existing)),
        )

    def _tls(
        self,
        job: n.JobRef,
        spec: DiLoCoJobSpec,
        existing: Mapping[tuple[str, str], Mapping[str, Any]],
        now: datetime.datetime,
    ) -> JobTls:
        """The job's TLS: its operator-made Secret as it lives (if this job owns it), naming the hosts its
        exposed shards are reached at, or the Secrets it names."""
        live = existing.get(("Secret", n.tls_secret_name(job.name)))
        named = {name: self.kube.get("Secret", job.namespace, name) for name in spec.tls_secrets}
        external = external_hosts(job.name, spec, _shard_services(job, spec, existing))
        live = live if live is not None and owned_by(live, job.uid) else None
        return job_tls(job, spec, live, named, now, external, ca_key=ca_key(self.token_key, job))

    def _tokens(
        self, job: n.JobRef, spec: DiLoCoJobSpec, existing: Mapping[tuple[str, str], Mapping[str, Any]]
    ) -> tuple[str | None, JobTokens | None]:
        """The job's token now (derived, or, against another cluster's shards, the token of the Secret it names:
        None while that Secret or its key is missing), and its token Secret as it lives (None: none of this
        job's, or a job against another cluster's shards)."""
        if spec.remote_syncers is not None:
            named = JobTokens.from_secret(self.kube.get("Secret", job.namespace, spec.remote_syncers.token_secret))
            return (named.presented if named else None), None
        live = existing.get(("Secret", n.token_secret_name(job.name)))
        owned = JobTokens.from_secret(live) if live is not None and owned_by(live, job.uid) else None
        return job_token(self.token_key, job, job.token_rotation), owned

    def reconcile(
        self,
        job: n.JobRef,
        generation: int | None,
        raw_spec: Mapping[str, Any],
        raw_status: Mapping[str, Any] | None,
        now: datetime.datetime,
    ) -> PassOutcome:
        """Raises pydantic's ValidationError for a spec the models refuse (the caller reports it). Does nothing
        while the job's namespace is being deleted: the pods the namespace controller removes are no failures,
        and neither a status nor an Event would say anything true (`terminating`)."""
        spec = DiLoCoJobSpec.model_validate(dict(raw_spec))
        if terminating(self.kube.get("Namespace", None, job.namespace)):
            return LEFT_ALONE
        previous = DiLoCoJobStatus.model_validate(dict(raw_status or {}))
        existing, raw_pods = self._list(job)
        wanted, live_tokens = self._tokens(job, spec, existing)
        tls = self._tls(job, spec, existing, now)
        probe: Security | str = tls.probe
        if wanted is None:  # the islands wait for the Secret too (the kubelet holds back pods that mount it)
            probe, wanted = f"spec.remoteSyncers.tokenSecret: no Secret with a '{n.TOKEN_KEY}' key", ""
        presented = live_tokens.presented if live_tokens is not None else wanted
        observed = self._observe(
            job, spec, previous, existing, raw_pods, list(dict.fromkeys([presented, wanted])), probe
        )
        decision = decide(spec, generation, previous, observed, now, job=job.name)
        events = list(decision.events)
        if spec.remote_syncers is None:
            held = {pod.token_hash for found in observed.pods.values() for pod in found if pod.token_hash}
            accepting = all(fingerprint(wanted) in s.accepts for s in observed.shards)
            tokens, rotating = rotation_step(wanted, live_tokens, held, accepting)
            events += rotating
        else:
            tokens = JobTokens.only(wanted)

        desired = render_children(job, spec, tokens, decision.scale, self.operator, tls=tls)
        others = self._unlisted(job, [child_key(obj) for obj in desired if child_key(obj) not in existing])
        held = shards_held_back(
            [obj for obj in desired if obj["kind"] == "Deployment"],
            {name: obj for (kind, name), obj in existing.items() if kind == "Deployment"},
        )
        stale: list[tuple[dict[str, Any], bool]] = []
        for obj in desired:
            if obj["kind"] == "Deployment" and obj["metadata"]["name"] in held:
                continue  # its shard's turn in the roll has not come
            live = existing.get(child_key(obj)) or others.get(child_key(obj))
            controller = foreign_controller(live, job.uid) if live is not None else None
            if controller is not None:
                events.append(
                    Event(
                        "Warning",
                        Reason.NAME_CONFLICT,
                        f"{'/'.join(child_key(obj))} is controlled by {controller}: left alone",
                    )
                )
                continue
            mine = live is not None and owned_by(live, job.uid)
            if not (mine and in_sync(live, obj)):
                stale.append((obj, mine))
        # Workloads last, so that their pods find the config, token, volumes and Services already there.
        waves = [[item for item in stale if (item[0]["kind"] in WORKLOADS) == last] for last in (False, True)]
        applied: list[str] = []
        created: list[str] = []
        for wave in waves:
            errors = self._each(lambda item: self.kube.apply(item[0], force=item[1]), wave)
            if any(error is not None and error.namespace_terminating for error in errors):
                return LEFT_ALONE  # the namespace began going after this pass looked: as if it had seen it
            for (obj, _), error in zip(wave, errors):
                if error is None:
                    applied.append("/".join(child_key(obj)))
                    if child_key(obj) not in existing:
                        created.append(applied[-1])
                else:
                    log.warning("apply failed", extra={"job": job.name, "object": child_key(obj), "error": str(error)})
                    events.append(Event("Warning", "ApplyFailed", f"{'/'.join(child_key(obj))}: {error.message}"))

        wanted = {child_key(obj) for obj in desired}
        pruned = [key for key, obj in existing.items() if key not in wanted and owned_by(obj, job.uid)]
        deleted: list[str] = []
        for key, error in zip(pruned, self._each(lambda key: self.kube.delete(key[0], job.namespace, key[1]), pruned)):
            if error is None:
                deleted.append("/".join(key))
            else:
                events.append(Event("Warning", "DeleteFailed", f"{'/'.join(key)}: {error.message}"))

        updated = [key for key in applied if key not in created]
        for reason, keys in (("Created", created), ("Updated", updated), ("Deleted", deleted)):
            if keys:
                events.append(Event("Normal", reason, f"{reason.lower()} {len(keys)}: {summarize(keys)}"))
        if decision.delete:
            self.kube.delete("DiLoCoJob", job.namespace, job.name)
        return PassOutcome(
            status=status_patch(decision.status),
            events=tuple(events),
            applied=tuple(applied),
            deleted=tuple(deleted),
            job_deleted=decision.delete,
        )
