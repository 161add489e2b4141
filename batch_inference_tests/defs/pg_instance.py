"""The Kubernetes instance settings of ``deploy/dagster/dagster.yaml``, on a real Postgres.

``deploy_instance_home`` writes a ``$DAGSTER_HOME/dagster.yaml`` made of the deploy file's
own sections, changing only what the test machine needs (the port its throwaway server
listens on) and leaving out the sections other tests cover against their own real
servers (the run launcher: the Kubernetes tests; compute logs: S3). Without the
K8sRunLauncher, run monitoring cannot resume runs: its resume count is set to 0.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from batch_inference_tests.fixtures.postgres import PostgresServer

DEPLOY_INSTANCE = Path(__file__).resolve().parents[2] / "deploy" / "dagster" / "dagster.yaml"


def deploy_instance_config(server: PostgresServer, *, keep: tuple[str, ...] = ("storage", "concurrency", "run_monitoring",
                                                                             "telemetry")) -> dict[str, Any]:
    config = yaml.safe_load(DEPLOY_INSTANCE.read_text())
    out = {key: copy.deepcopy(config[key]) for key in keep if key in config}
    if "storage" in out:
        out["storage"]["postgres"]["postgres_db"]["port"] = server.port
    if "run_launcher" not in out and "run_monitoring" in out:
        out["run_monitoring"]["max_resume_run_attempts"] = 0  # resuming is the K8sRunLauncher's (not loaded here)
    return out


def deploy_instance_home(home: Path, server: PostgresServer, **kw: Any) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(yaml.safe_dump(deploy_instance_config(server, **kw), sort_keys=False))
    return home
