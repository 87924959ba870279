"""Run a rendered command line the way its container's securityContext would, without a cluster.

A private mount namespace (`unshare --mount`) in which the root filesystem is read-only and only the
container's emptyDir mount paths are writable (fresh tmpfs mounts), then `setpriv` drops to the
pod's runAsUser / runAsGroup with no supplementary groups, no capabilities (drop ALL) and
no_new_privs (allowPrivilegeEscalation: false). The host's mounts are not touched: unshare makes the
new namespace's mounts private. Needs root and util-linux; `available()` says whether it works here.

A host quirk: this project's interpreter may sit under a directory other users cannot enter (pyenv
under /root, mode 700). The pod's image has no such directory, so in the namespace that directory is
covered by an empty tmpfs (mode 755) into which only the paths the process needs are bound back.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _blocked(path: Path) -> tuple[Path, Path] | None:
    """(the first ancestor of path other users cannot enter, path) or None when all can be entered."""
    for parent in reversed(path.parents):
        if parent != Path("/") and not os.stat(parent).st_mode & 0o001:
            return parent, path
    return None


def _needed() -> list[Path]:
    """What a process of this project's virtualenv reads: the interpreter's installation, the venv, the repo."""
    return [Path(sys.base_prefix).resolve(), Path(sys.prefix), ROOT]


@cache
def available() -> str | None:
    """None when sandboxed commands can run here, or why not."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (a mount namespace and setuid)"
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"no {tool} (util-linux)"
    for path in _needed():
        if Path("/tmp") in (path, *path.parents):  # the containers' /tmp emptyDir would hide it
            return f"{path} is under /tmp, which the sandbox covers with the pod's emptyDir"
        hit = _blocked(path)
        # only the first closed directory is covered: any below it would still be closed
        below = [d for d in (*path.parents, path) if hit is not None and hit[0] in d.parents]
        if any(not os.stat(d).st_mode & 0o001 for d in below):
            return f"{path}: more than one directory on the way that others cannot enter"
    probe = subprocess.run(command(["true"], uid=65534, gid=65534, writable=["/tmp"]), capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"mount namespace refused: {probe.stderr.strip()}"
    return None


def command(
    argv: Sequence[str], *, uid: int, gid: int, writable: Sequence[str], cwd: str = "/", python: bool = True
) -> list[str]:
    """argv wrapped: read-only root, tmpfs at each writable path, then uid:gid without capabilities.
    python: argv runs on this project's interpreter (see the module docstring)."""
    steps = ["mount -n -o remount,ro,bind /"]
    for path in writable:
        # an emptyDir: empty and writable by the pod's user (fsGroup would see to that in Kubernetes)
        steps.append(f"mount -n -t tmpfs -o size=256m,mode=1777 tmpfs {shlex.quote(path)}")
    holds = [hit for hit in (_blocked(p) for p in _needed()) if hit is not None] if python else []
    if holds:
        # parked on the first emptyDir while their ancestor is covered (anything else is read-only)
        assert writable, "a writable path is needed to park the interpreter's directories"
        parked = [f"{writable[0]}/.hold-{n}" for n in range(len(holds))]
        for hold, (_, needed) in zip(parked, holds, strict=True):
            steps += [f"mkdir {hold}", f"mount -n --rbind {shlex.quote(str(needed))} {hold}"]
        for ancestor in dict.fromkeys(a for a, _ in holds):
            steps.append(f"mount -n -t tmpfs -o size=1m,mode=755 tmpfs {shlex.quote(str(ancestor))}")
        for hold, (_, needed) in zip(parked, holds, strict=True):
            steps += [
                f"mkdir -p {shlex.quote(str(needed))}",
                f"mount -n --move {hold} {shlex.quote(str(needed))}",
                f"rmdir {hold}",
            ]
    steps.append(f"cd {shlex.quote(cwd)}")
    steps.append(
        f'exec setpriv --reuid={uid} --regid={gid} --clear-groups --no-new-privs --inh-caps=-all --bounding-set=-all -- "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec", " && ".join(steps), "sandbox", *argv]
