"""The Kubernetes Pod Security Standards' "baseline" and "restricted" profiles, checked on a rendered pod.

Written from the profiles' definition in the Kubernetes documentation (concepts/security/pod-security-
standards, policy version "latest" as of Kubernetes 1.33); the same rules the PodSecurity admission
controller enforces for a namespace labelled pod-security.kubernetes.io/enforce=restricted. Each check
says which control it is, so a failing test names the rule, not a line of YAML. Windows-only controls
(hostProcess) and the optional ones a pod here never sets (AppArmor annotations) are included too, so a
value copied in from elsewhere cannot slip through.

Only what the admission controller would see in the pod template is judged: the image's own USER is
invisible to it, which is why "runAsNonRoot: true" must be spelled out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Baseline: capabilities a container may add (Docker's default set).
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# Restricted: the only capability that may be added after dropping ALL.
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# Restricted: the volume types allowed (everything else, hostPath and the in-tree network volumes, is not).
RESTRICTED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
# Baseline: the namespaced sysctls known to be safe.
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
        "net.ipv4.tcp_rmem",
        "net.ipv4.tcp_wmem",
    }
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
SECCOMP_BASELINE = frozenset({"RuntimeDefault", "Localhost"})  # not Unconfined (unset is fine in baseline)

WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"})


def pod_of(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(metadata, spec) of the pod a manifest runs, or None for a manifest that runs none."""
    if doc["kind"] == "Pod":
        return doc.get("metadata", {}), doc["spec"]
    if doc["kind"] in WORKLOAD_KINDS:
        template = doc["spec"]["template"]
        return template.get("metadata", {}), template["spec"]
    if doc["kind"] == "CronJob":
        template = doc["spec"]["jobTemplate"]["spec"]["template"]
        return template.get("metadata", {}), template["spec"]
    return None


def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(field) or []:
            yield f"{field}[{c.get('name')}]", c


def baseline_violations(metadata: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """The baseline controls a pod breaks, one line each ("<control>: <where>")."""
    out: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("HostProcess: spec.securityContext.windowsOptions.hostProcess")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"Host Namespaces: spec.{field}")
    for v in spec.get("volumes") or []:
        if "hostPath" in v:
            out.append(f"HostPath Volumes: volume {v.get('name')}")
    for key, value in (metadata.get("annotations") or {}).items():
        if (
            key.startswith("container.apparmor.security.beta.kubernetes.io/")
            and value != "runtime/default"
            and not str(value).startswith("localhost/")
        ):
            out.append(f"AppArmor: annotation {key}={value}")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"Sysctls: {sysctl.get('name')}")
    contexts = [("spec.securityContext", pod_sc)]
    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        contexts.append((where, sc))
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where}")
        if sc.get("privileged"):
            out.append(f"Privileged Containers: {where}")
        extra = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if extra:
            out.append(f"Capabilities: {where} adds {sorted(extra)}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"Host Ports: {where} hostPort {port['hostPort']}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"/proc Mount Type: {where}")
    for where, sc in contexts:
        profile = (sc.get("seccompProfile") or {}).get("type")
        if profile is not None and profile not in SECCOMP_BASELINE:
            out.append(f"Seccomp: {where} {profile}")
        apparmor = (sc.get("appArmorProfile") or {}).get("type")
        if apparmor is not None and apparmor not in ("RuntimeDefault", "Localhost"):
            out.append(f"AppArmor: {where} {apparmor}")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"SELinux: {where} {se}")
    return out


def restricted_violations(metadata: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """The restricted controls a pod breaks (baseline's included), one line each."""
    out = baseline_violations(metadata, spec)
    pod_sc = spec.get("securityContext") or {}
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            out.append(f"Volume Types: volume {v.get('name')} is {sorted(kinds - RESTRICTED_VOLUME_TYPES)}")
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in SECCOMP_BASELINE
    if pod_sc.get("runAsUser") == 0:
        out.append("Running as Non-root user: spec.securityContext.runAsUser 0")
    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"Privilege Escalation: {where} allowPrivilegeEscalation is not false")
        # set on the container, or inherited from the pod without the container saying false
        if not (sc.get("runAsNonRoot") is True or (pod_non_root and sc.get("runAsNonRoot") is not False)):
            out.append(f"Running as Non-root: {where} runAsNonRoot is not true")
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {where} runAsUser 0")
        profile = (sc.get("seccompProfile") or {}).get("type")
        if not (profile in SECCOMP_BASELINE or (profile is None and pod_seccomp)):
            out.append(f"Seccomp: {where} needs RuntimeDefault or Localhost (on it or the pod)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"Capabilities: {where} does not drop ALL")
        extra = set(caps.get("add") or []) - RESTRICTED_CAPABILITIES
        if extra:
            out.append(f"Capabilities: {where} adds {sorted(extra)} (only NET_BIND_SERVICE)")
    return out
