"""Dagster: a Parquet dataset runs through the assets to the parquet_export asset its spec asks for."""

from __future__ import annotations

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batch_inference.defs.driver import drive, start_run
from batch_inference.defs.keys import PARQUET_EXPORT, RESULTS
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference_tests.defs.helpers import latest, simulated_spec


def test_a_parquet_run_ends_in_the_parquet_export_asset(defs, instance, tmp_path) -> None:
    folder = tmp_path / "drop"
    folder.mkdir()
    for f in range(2):
        pq.write_table(pa.table({"id": [f"p{f}-{i}" for i in range(20)], "prompt": [f"q {f} {i} ü" for i in range(20)],
                                 "meta": [{"n": i} for i in range(20)]}), folder / f"part-{f}.parquet")
    spec = simulated_spec("pq", folder, tmp_path / "runs", max_rounds=2, export=["parquet"])
    spec_path = tmp_path / "pq.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    assert start_run(defs, instance, start_run_config(str(spec_path))).success
    result = drive(defs, instance)
    assert all(r.success for r in result.launched)
    assert latest(instance, dg.AssetKey("sharded"), "pq")["input_format"] == "parquet"
    meta = latest(instance, PARQUET_EXPORT, "pq")
    res = latest(instance, RESULTS, "pq")
    assert meta["dagster/row_count"] == 40 and meta["by_status"].get("approved", 0) == res["approved"]
    out = pq.read_table(tmp_path / "runs" / "pq" / "export" / "parquet")
    assert sorted(out["id"].to_pylist()) == sorted(f"p{f}-{i}" for f in range(2) for i in range(20))
    assert out.schema.field("meta").type == pa.struct([("n", pa.int64())])
