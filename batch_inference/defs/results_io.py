"""Downstream use of a pipeline's results: an IO manager that hands them to the user's asset.

``<prefix>/results`` writes nothing through Dagster (its rows are in the run's storage,
``<output>/<run>/results/``); a user's asset that takes it as an input gets, by the type
annotation of its parameter:

- ``str`` / ``pathlib.Path``: the results folder's URL;
- ``pyarrow.dataset.Dataset``: the rows as a dataset (the run's Parquet export when the
  spec asked for one, else the JSONL rows read into one Arrow table);
- anything else (``Iterator``, ``Iterable``, no annotation; Dagster takes bare classes, not ``Iterator[dict]``): an iterator of rows,
  streamed shard by shard.

The run comes from the input's partition: an unpartitioned downstream depends on every
run; give it ``AssetIn(partition_mapping=dg.LastPartitionMapping())`` to take the newest
run only. Several runs: a dict ``{run: value}``.
"""


import collections.abc
import pathlib
from collections.abc import Iterator
from typing import Any, get_origin

import dagster as dg

from batch_inference.defs.specs import load_spec
from batch_inference.defs.storage.resources import StorageResource

RESULTS_IO_MANAGER_KEY = "batch_inference_results"


def _rows(url: str, storage_options: dict) -> Iterator[dict]:
    from batch_inference.storage import JsonlDir

    yield from JsonlDir(url, storage_options=storage_options).iter_records_sync()


class ResultsIOManager(dg.ConfigurableIOManager):
    """Loads ``<prefix>/results[run]`` for a downstream asset as rows, a path or a pyarrow dataset."""

    storage: dg.ResourceDependency[StorageResource]

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        if obj is not None:
            raise TypeError(f"{context.asset_key.to_user_string()}: results live in the run's storage; the asset returns no value")

    def load_input(self, context: dg.InputContext) -> Any:
        key = context.asset_key
        source = dg.AssetKey([*key.path[:-1], "source_dataset"])
        runs = list(context.asset_partition_keys) if context.has_asset_partitions else []
        if not runs:
            raise dg.Failure(f"{key.to_user_string()}: no run to load (no partition of it is mapped to this asset)")
        want = context.dagster_type.typing_type if context.dagster_type is not None else Any
        values = {run: self._load(context, source, run, want) for run in runs}
        return values[runs[0]] if len(runs) == 1 else values

    def _load(self, context: dg.InputContext, source: dg.AssetKey, run: str, want: Any) -> Any:
        from batch_inference.pipeline.layout import RunLayout

        spec = load_spec(context.instance, run, self.storage, source)
        layout = RunLayout(spec.output, spec.run)
        if want in (str, pathlib.Path):
            return want(layout.results)
        if getattr(want, "__module__", "").startswith("pyarrow") and getattr(want, "__name__", "") in ("Dataset", "FileSystemDataset"):
            import pyarrow as pa
            import pyarrow.dataset as ds

            if "parquet" in spec.export:
                return ds.dataset(layout.parquet_export, format="parquet")
            return ds.dataset(pa.Table.from_pylist(list(_rows(layout.results, spec.storage_options))))
        if want is Any or get_origin(want) in (collections.abc.Iterator, collections.abc.Iterable) or want in (
                collections.abc.Iterator, collections.abc.Iterable, object):
            return _rows(layout.results, spec.storage_options)
        raise TypeError(f"{context.asset_key.to_user_string()}: cannot load results as {want!r}; "
                        "annotate the input as Iterator[dict], str, pathlib.Path or pyarrow.dataset.Dataset")
