"""What a kubelet would make of a pod, computed without I/O so it can be tested alone: the environment of a
container (env with $(VAR) expansion, ConfigMap and Secret references, the downward API, envFrom), the files
of its ConfigMap, Secret and projected volumes, container paths rewritten to where volumes live on this
machine, and the /etc/hosts a pod sees: names of Services and of pods behind headless Services resolve to
their endpoints' pod IPs (cluster DNS has no equivalent here), so a Service's port must equal its target port,
as it does for every Service this project makes. pod_runner.py does the I/O; pod_network.py makes pod IPs real.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

CLUSTER_DOMAIN = "cluster.local"

Data = Mapping[str, str | bytes]
"""A ConfigMap's or Secret's data: a ConfigMap's values are text, a Secret's the bytes it holds (a key file, a
keystore: not necessarily text)."""
Lookup = Callable[[str, str], Data | None]
"""(kind "ConfigMap" or "Secret", name) -> the object's data in the pod's namespace (Secret values decoded
from base64), or None when it does not exist."""


class Unresolvable(Exception):
    """The container cannot be configured yet (the kubelet's CreateContainerConfigError)."""


def secret_data(secret: Mapping[str, Any]) -> dict[str, bytes]:
    """A Secret's data (base64 in the API) and stringData, as bytes: a Secret may hold any bytes, and a kubelet
    writes them to files as they are."""
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    return data | {k: v.encode() for k, v in (secret.get("stringData") or {}).items()}


def text(value: str | bytes) -> str:
    """A value as an environment variable holds it: bytes that are not UTF-8 kept as they are (Python's
    surrogateescape, which turns them back into the same bytes when the process starts)."""
    return value if isinstance(value, str) else os.fsdecode(value)


_FIELD_LABEL = re.compile(r"metadata\.(labels|annotations)\['(.+)'\]$")


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """A downward-API fieldRef of `pod`."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    match = _FIELD_LABEL.match(path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
    }
    if path not in simple:
        raise Unresolvable(f"fieldRef {path} is not supported by the pod runner")
    if simple[path] is None:
        raise Unresolvable(f"fieldRef {path} has no value yet")
    return simple[path]


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ escapes, anything else stays as is."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(one, value)


def _data(lookup: Lookup, kind: str, ref: Mapping[str, Any]) -> Data | None:
    """The referenced object's data; None for a missing optional one."""
    data = lookup(kind, ref["name"])
    if data is None and not ref.get("optional"):
        raise Unresolvable(f"{kind} {ref['name']} not found")
    return data


def _value(lookup: Lookup, kind: str, ref: Mapping[str, Any], key: str) -> str | bytes | None:
    """One key of the referenced object; None for a missing optional one."""
    data = _data(lookup, kind, ref)
    if data is not None and key in data:
        return data[key]
    if ref.get("optional"):
        return None
    raise Unresolvable(f"{kind} {ref['name']} key {key} not found")


def resolve_env(pod: Mapping[str, Any], container: Mapping[str, Any], lookup: Lookup) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env in order, each value
    expanded against what was defined before it."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or ():
        prefix = source.get("prefix", "")
        for kind, field in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if field in source:
                env |= {prefix + k: text(v) for k, v in (_data(lookup, kind, source[field]) or {}).items()}
    for item in container.get("env") or ():
        if "valueFrom" not in item:
            env[item["name"]] = expand(item.get("value", ""), env)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            value: str | bytes | None = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source:
            value = _value(lookup, "ConfigMap", source["configMapKeyRef"], source["configMapKeyRef"]["key"])
        elif "secretKeyRef" in source:
            value = _value(lookup, "Secret", source["secretKeyRef"], source["secretKeyRef"]["key"])
        else:
            raise Unresolvable(f"env {item['name']}: {sorted(source)} is not supported by the pod runner")
        if value is not None:
            env[item["name"]] = text(value)
    return env


def _object_files(lookup: Lookup, kind: str, source: Mapping[str, Any], name: str) -> dict[str, str | bytes]:
    data = _data(lookup, kind, {"name": name, "optional": source.get("optional")}) or {}
    items = source.get("items")
    if not items:
        return dict(data)
    return {item["path"]: data[item["key"]] for item in items if item["key"] in data}


def projected_files(
    volume: Mapping[str, Any], pod: Mapping[str, Any], lookup: Lookup, token: Callable[[Mapping[str, Any]], str]
) -> dict[str, str | bytes] | None:
    """relative path -> content of a ConfigMap, Secret or projected volume (None for other kinds of volume);
    `token` makes a service-account token for a projected serviceAccountToken source (as the admission
    plugin adds to every pod that mounts its service account's credentials)."""
    if "configMap" in volume:
        return _object_files(lookup, "ConfigMap", volume["configMap"], volume["configMap"]["name"])
    if "secret" in volume:
        return _object_files(lookup, "Secret", volume["secret"], volume["secret"]["secretName"])
    if "projected" not in volume:
        return None
    files: dict[str, str | bytes] = {}
    for source in volume["projected"].get("sources") or ():
        if "serviceAccountToken" in source:
            files[source["serviceAccountToken"]["path"]] = token(source["serviceAccountToken"])
        elif "configMap" in source:
            files |= _object_files(lookup, "ConfigMap", source["configMap"], source["configMap"]["name"])
        elif "secret" in source:
            files |= _object_files(lookup, "Secret", source["secret"], source["secret"]["name"])
        elif "downwardAPI" in source:
            files |= {
                item["path"]: field_value(pod, item["fieldRef"]["fieldPath"])
                for item in source["downwardAPI"].get("items") or ()
            }
        else:
            raise Unresolvable(f"projected source {sorted(source)} is not supported by the pod runner")
    return files


def container_command(container: Mapping[str, Any], entrypoint: Sequence[str], cmd: Sequence[str]) -> list[str]:
    """What the runtime executes: `command` replaces the image's ENTRYPOINT, `args` its CMD (and a `command`
    without `args` drops the CMD), as Kubernetes defines it."""
    if container.get("command"):
        return [*container["command"], *(container.get("args") or ())]
    return [*entrypoint, *(container.get("args") if container.get("args") is not None else cmd)]


def rewrite_paths(value: str, mounts: Mapping[str, str]) -> str:
    """`value` with a leading container mount path (or the path itself) replaced by the local directory."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return mounts[mount_path] + value[len(mount_path.rstrip("/")) :]
    return value


def service_names(slices: Iterable[Mapping[str, Any]]) -> list[tuple[str, list[str], str]]:
    """(pod IP, DNS names, namespace) for every endpoint of every EndpointSlice: the Service's own names
    (`svc.ns`, `svc.ns.svc`, `svc.ns.svc.cluster.local`) and, for endpoints with a hostname (pods of a
    headless Service), `host.svc.ns.svc` and `host.svc.ns.svc.cluster.local`. Endpoints not ready are left
    out, as cluster DNS does (Services that publish not-ready addresses mark them ready)."""
    out: list[tuple[str, list[str], str]] = []
    for item in slices:
        meta = item["metadata"]
        service = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if not service or item.get("addressType") != "IPv4":
            continue
        ns = meta["namespace"]
        base = f"{service}.{ns}"
        for endpoint in item.get("endpoints") or ():
            if (endpoint.get("conditions") or {}).get("ready") is False or not endpoint.get("addresses"):
                continue
            names = [base, f"{base}.svc", f"{base}.svc.{CLUSTER_DOMAIN}"]
            if endpoint.get("hostname"):
                host = f"{endpoint['hostname']}.{base}.svc"
                names += [host, f"{host}.{CLUSTER_DOMAIN}"]
            out.append((endpoint["addresses"][0], names, ns))
    return out


def render_hosts(
    entries: Iterable[tuple[str, list[str], str]],
    own: tuple[str, list[str]] | None = None,
    namespace: str | None = None,
) -> str:
    """An /etc/hosts: localhost, the pod's own names (`own`: pod IP, names), then every Service
    entry; in `namespace`, Services also answer to their bare name, as through the DNS search path."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    if own is not None:
        lines.append(f"{own[0]}\t{' '.join(own[1])}")
    for ip, names, ns in entries:
        if ns == namespace:
            names = [names[0].split(".", 1)[0], *names]
        lines.append(f"{ip}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"


def own_names(pod: Mapping[str, Any]) -> list[str]:
    """The names a pod knows itself by: its hostname, and its FQDN when it sets a subdomain."""
    meta, spec = pod["metadata"], pod["spec"]
    hostname = spec.get("hostname") or meta["name"]
    names = [hostname]
    if spec.get("subdomain"):
        fqdn = f"{hostname}.{spec['subdomain']}.{meta['namespace']}.svc"
        names = [f"{fqdn}.{CLUSTER_DOMAIN}", fqdn, *names]
    return names


def accelerators(pod: Mapping[str, Any]) -> int:
    """How many devices of extended resources such as nvidia.com/gpu a pod asks for, over its containers
    (each container's larger of request and limit)."""
    total = 0
    for container in pod["spec"].get("containers") or ():
        resources = container.get("resources") or {}
        asked: dict[str, int] = {}
        for kind in ("requests", "limits"):
            for name, quantity in (resources.get(kind) or {}).items():
                if "/" in name:
                    asked[name] = max(asked.get(name, 0), int(quantity))
        total += sum(asked.values())
    return total
