"""Writes an OCI image archive (the layout `ctr images import`, `podman load` and
`skopeo copy oci-archive:` read) from one filesystem tar, without a container builder.

    python3 oci_archive.py --layer rootfs.tar --tag batch-inference:0.1.0-cpu --out image.tar \
        [--entrypoint JSON] [--cmd JSON] [--env K=V ...] [--user 1000:1000] [--workdir DIR]

The layer is stored uncompressed (no gzip pass over a ~1 GB tree on a 2-core machine);
the image is named ``docker.io/library/<tag>`` for containerd (what a pod's ``image: <tag>``
resolves to) and ``<tag>`` for other readers. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_archive(layer: Path, tag: str, out: Path, config: dict) -> None:
    """``layer`` is moved into the archive's blob store; ``out`` is written atomically."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        blobs = Path(tmp) / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        layer_digest, layer_size = _sha256_file(layer), layer.stat().st_size
        shutil.move(str(layer), blobs / layer_digest)

        def blob(obj: dict) -> dict:
            data = json.dumps(obj, separators=(",", ":")).encode()
            digest = hashlib.sha256(data).hexdigest()
            (blobs / digest).write_bytes(data)
            return {"digest": f"sha256:{digest}", "size": len(data)}

        cfg = blob({"architecture": "amd64", "os": "linux", "config": config,
                    "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]}})
        manifest = blob({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                         "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **cfg},
                         "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                                     "digest": f"sha256:{layer_digest}", "size": layer_size}]})
        name = tag if "/" in tag.split(":")[0] and "." in tag.split("/")[0] else f"docker.io/library/{tag}"
        (Path(tmp) / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest,
            "annotations": {"org.opencontainers.image.ref.name": tag, "io.containerd.image.name": name}}]}))
        (Path(tmp) / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
        partial = out.with_name(out.name + ".tmp")
        with tarfile.open(partial, "w") as tar:
            for entry in ("oci-layout", "index.json", "blobs"):
                tar.add(Path(tmp) / entry, arcname=entry)
        os.replace(partial, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layer", type=Path, required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--entrypoint", type=json.loads, default=None)
    p.add_argument("--cmd", type=json.loads, default=None)
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--user", default="")
    p.add_argument("--workdir", default="")
    a = p.parse_args()
    config = {"Env": a.env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
    for key, value in (("Entrypoint", a.entrypoint), ("Cmd", a.cmd), ("User", a.user), ("WorkingDir", a.workdir)):
        if value:
            config[key] = value
    write_archive(a.layer, a.tag, a.out, config)


if __name__ == "__main__":
    main()
