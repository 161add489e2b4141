"""Start one container's command the way a kubelet would, minus the image: ``python -m ... SPEC``.

Run by the node agent as ``ip netns exec <pod netns> unshare --mount --uts ...``, so the
process has its own network namespace (its own address), mount namespace and hostname
(the pod's name). There the pod's volumes (files the agent wrote from its Secrets and
ConfigMaps) are bind-mounted at their ``mountPath``; a missing mount point is made
inside an overlay of its nearest existing parent, so the host's directories are never
touched. Then the container's command replaces this process (same PID).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def _mount(*argv: str) -> None:
    subprocess.run(["mount", *argv], check=True, capture_output=True)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    scratch = Path(spec["scratch"])
    overlaid: set[Path] = set()
    for i, m in enumerate(spec["mounts"]):
        target = Path(m["mountPath"])
        if not target.exists():
            parent = target
            while not parent.exists():
                parent = parent.parent
            parent = parent.resolve()
            # inside an overlay made for an earlier mount, a directory is simply made (a second
            # overlay there would hide the earlier bind mounts below it)
            if not any(parent == o or o in parent.parents for o in overlaid):
                upper, work = scratch / f"upper{i}", scratch / f"work{i}"
                upper.mkdir(parents=True)
                work.mkdir(parents=True)
                _mount("-t", "overlay", "overlay", "-o", f"lowerdir={parent},upperdir={upper},workdir={work}", str(parent))
                overlaid.add(parent)
            target.mkdir(parents=True, exist_ok=True)
        _mount("--bind", m["source"], str(target))
        if m.get("readOnly"):
            _mount("-o", "remount,bind,ro", str(target))
    socket.sethostname(spec["hostname"])  # its own UTS namespace: the pod's name, as in a container
    os.chdir(spec.get("workingDir") or "/")
    argv = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])


if __name__ == "__main__":
    main(sys.argv[1])
