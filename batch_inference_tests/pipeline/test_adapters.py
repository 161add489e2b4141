"""LoRA adapters through the pipeline: infer.adapter, judge.adapter and per-record adapters,
bounded by the spec, checked before any inference, recorded in the ledger.

The simulated engine serves adapters by name (``simulated.lora``: outputs salted by the
adapter), so most paths here run without a model; the transformers engine serves real
adapters through peft (``transformers.lora``, a run at the end); vLLM is in vllm_cpu/test_lora.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.engines import build_engine
from batch_inference.pipeline import PipelineSpec, SpecError, run_pipeline
from batch_inference.pipeline.preflight import preflight
from batch_inference.prompting import RequestBuilder
from batch_inference.storage import JsonlDir
from batch_inference_tests.pipeline.helpers import run_infer_on_adapter_judge_on_base, spec_dict

LORA = {"adapters": {"a1": "/unread/a1", "a2": "/unread/a2"}, "max_loras": 2}
APPROVE_ALL = {"kind": "rule", "callable": "min_length", "kwargs": {"min_chars": 1}}


def adapter_spec(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    overrides = {"judge": APPROVE_ALL, "max_rounds": 1, **overrides}
    data = spec_dict(tmp_path, records=0, **overrides)
    data["engine"]["simulated"]["lora"] = LORA
    return data


def write_records(path: Path, adapters: list[str | None]) -> None:
    with open(path, "wb") as f:
        for i, adapter in enumerate(adapters):
            rec: dict[str, Any] = {"id": f"r{i}", "prompt": "the same question"}
            if adapter != "-":
                rec["adapter"] = adapter
            f.write(orjson.dumps(rec) + b"\n")


async def test_per_record_adapters_give_that_adapters_outputs(tmp_path: Path) -> None:
    names = ["a1", "a2", None, "-", "a1", "zz"]  # "-": no adapter field (the phase's: infer.adapter a2)
    write_records(tmp_path / "input.jsonl", names)
    spec = PipelineSpec.parse(adapter_spec(tmp_path, infer={"adapter": "a2"}))
    summary = await run_pipeline(spec)
    root = Path(spec.output) / spec.run
    rows = {r["id"]: r for r in JsonlDir(str(root / "results")).iter_records_sync()}
    failed = list(JsonlDir(str(root / "round-00" / "failed-records")).iter_records_sync())
    assert summary.approved == 5 and [r["id"] for r in failed] == ["r5"]
    assert failed[0]["error"].startswith("bad_request") and "adapter 'zz' is not one of the spec's adapters: a1, a2" in failed[0]["error"]
    # each result is what the engine answers for that record's request on that adapter
    engine = build_engine(spec.engine)
    builder = RequestBuilder(spec.request_infer)  # what tasks carry: the engine's adapters
    for rid, row in rows.items():
        request = builder.build({k: v for k, v in row.items() if k in ("id", "prompt", "adapter")}, 0)
        assert request.params.adapter == {"r0": "a1", "r1": "a2", "r2": None, "r3": "a2", "r4": "a1"}[rid]
        assert row["result"] == engine.generate([request.prompt], request.params)[0].text
        others = [replace(request.params, adapter=a) for a in ("a1", "a2", None) if a != request.params.adapter]
        assert all(row["result"] != c.text for c in engine.generate([request.prompt] * 2, others))  # not another adapter's
    infer = orjson.loads((root / "ledger" / "round-00-infer.json").read_bytes())
    assert infer["ran_on"]["adapter"] == "a2"


async def test_an_infer_adapter_and_a_judge_on_the_base_model_in_one_run(tmp_path: Path) -> None:
    write_records(tmp_path / "input.jsonl", ["-"] * 20)
    data = adapter_spec(tmp_path, infer={"adapter": "a1"}, judge={"kind": "llm", "template": "Judge: {result}"}, max_rounds=1)
    spec = PipelineSpec.parse(data)
    await run_pipeline(spec)
    ledger = Path(spec.output) / spec.run / "ledger"
    assert orjson.loads((ledger / "round-00-infer.json").read_bytes())["ran_on"]["adapter"] == "a1"
    assert orjson.loads((ledger / "round-00-judge.json").read_bytes())["ran_on"]["adapter"] is None
    judged = PipelineSpec.parse({**data, "run": "judge-adapter", "judge": {**data["judge"], "adapter": "a2"}})
    assert judged.placement("judge")["adapter"] == "a2"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"infer": {"adapter": "a3"}}, r"infer.adapter: 'a3' is not one of engine.simulated.lora.adapters \(a1, a2\)"),
    ({"judge": {"kind": "llm", "template": "{result}", "adapter": "a3"}}, r"judge.adapter: 'a3' is not one of engine.simulated.lora"),
    ({"infer": {"adapters": ["a1", "a9"]}}, r"infer.adapters: \['a9'\] not among engine.simulated.lora.adapters"),
    ({"judge": {**APPROVE_ALL, "adapter": "a1"}}, "judge: 'adapter' is for llm judges"),
])
def test_an_adapter_outside_the_spec_is_refused_naming_its_key(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        PipelineSpec.parse(adapter_spec(tmp_path, **overrides))


def test_adapters_on_an_engine_without_lora_are_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = spec_dict(tmp_path, engine={"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"},
                     infer={"adapter": "a1"})
    with pytest.raises(SpecError, match=r"infer.adapter: engine kind 'transformers' serves no LoRA adapters "
                                        r"\(give it engine.transformers.lora\)"):
        PipelineSpec.parse(data)


def test_validate_checks_every_adapter_folder_before_any_inference(tmp_path: Path, tiny_model_dir: Path,
                                                                   tiny_adapters: dict[str, Path]) -> None:
    vllm = {"kind": "vllm", "model": str(tiny_model_dir), "dtype": "float32",
            "vllm": {"lora": {"adapters": {"a1": str(tiny_adapters["a1"]), "gone": str(tmp_path / "gone")}}}}
    data = spec_dict(tmp_path, engine=vllm, infer={"adapter": "a1"})
    with pytest.raises(SpecError, match=r"engine.vllm.lora.adapters.gone: adapter folder .*gone.* does not exist"):
        preflight(PipelineSpec.parse(data))
    # the judge's own engine is checked the same way, under its own key
    ok = {**vllm, "vllm": {"lora": {"adapters": {"a1": str(tiny_adapters["a1"])}, "max_lora_rank": 4}}}
    data = spec_dict(tmp_path, engine={**vllm, "vllm": {"lora": {"adapters": {"a1": str(tiny_adapters["a1"])}}}},
                     judge={"engine": ok, "adapter": "a1"})
    with pytest.raises(SpecError, match=r"judge.engine.vllm.lora.adapters.a1: .* rank 8 > max_lora_rank 4"):
        preflight(PipelineSpec.parse(data))


def transformers_lora(model: Path, adapters: dict[str, Path], **options: Any) -> dict[str, Any]:
    lora = {"adapters": {name: str(path) for name, path in adapters.items()}, "max_loras": 2}
    return {"kind": "transformers", "model": str(model), "device": "cpu", "transformers": {**options, "lora": lora}}


def test_validate_takes_lora_on_transformers_and_names_a_bad_adapter_folder(tmp_path: Path, tiny_model_dir: Path,
                                                                          tiny_adapters: dict[str, Path]) -> None:
    import yaml
    from click.testing import CliRunner

    from batch_inference.cli.main import cli

    engine = transformers_lora(tiny_model_dir, tiny_adapters)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(tmp_path, records=10, engine=engine, infer={"adapter": "a1"},
                                                  judge={"kind": "llm", "template": "{result}", "adapter": "a2"})))
    result = CliRunner().invoke(cli, ["validate", str(spec_path)])
    assert result.exit_code == 0, result.output
    gone = transformers_lora(tiny_model_dir, {"a1": tiny_adapters["a1"], "gone": tmp_path / "gone"})
    spec_path.write_text(yaml.safe_dump(spec_dict(tmp_path, engine=gone, infer={"adapter": "a1"})))
    result = CliRunner().invoke(cli, ["validate", str(spec_path)])
    assert result.exit_code == 1
    assert "engine.transformers.lora.adapters.gone: adapter folder" in result.output and "does not exist" in result.output
    # a judge on its own transformers engine: its adapters are checked under its own key
    data = spec_dict(tmp_path, engine=engine, judge={"engine": gone, "adapter": "a1"})
    with pytest.raises(SpecError, match=r"judge.engine.transformers.lora.adapters.gone: adapter folder .*gone.* does not exist"):
        preflight(PipelineSpec.parse(data))
    with pytest.raises(SpecError, match=r"judge.adapter: 'a2' is not one of judge.engine.transformers.lora.adapters \(a1, gone\)"):
        PipelineSpec.parse(spec_dict(tmp_path, engine=engine, judge={"engine": gone, "adapter": "a2"}))


async def test_an_adapter_infer_phase_and_a_base_model_judge_on_transformers(tmp_path: Path, tiny_model_dir: Path,
                                                                            tiny_adapters: dict[str, Path]) -> None:
    from batch_inference_tests.engines.peft_reference import greedy_texts

    prompts = ["The quick brown fox", "Question: what is the capital of France?", "Summarise the article in one",
               "Large language models generate", "def add(a, b):", "Translate the following sentence"]
    choices = ["-", "a2", None, "a1", "-", "a2"]  # "-": no adapter field (the phase's, infer.adapter a1)
    src = tmp_path / "input.jsonl"
    with open(src, "wb") as f:
        for i, (prompt, adapter) in enumerate(zip(prompts, choices)):
            rec: dict[str, Any] = {"id": f"r{i}", "prompt": prompt}
            if adapter != "-":
                rec["adapter"] = adapter
            f.write(orjson.dumps(rec) + b"\n")
    spec = PipelineSpec.parse(spec_dict(
        tmp_path, engine=transformers_lora(tiny_model_dir, tiny_adapters),
        infer={"template": "{prompt}", "adapter": "a1", "sampling": {"max_tokens": 10, "temperature": 0.0}},
        judge={"kind": "llm", "template": "{prompt} {result} Reply APPROVED or REJECTED:", "max_tokens": 4},
        max_rounds=1, shard_records=3, chunk_size=3, pool={"concurrency": 2, "batcher": {"batch_timeout_s": 0.01}},
    ))
    rows = await run_infer_on_adapter_judge_on_base(spec, records=6, adapter="a1")
    # every record's result is peft's own answer on that record's adapter (None: the plain base model)
    engine = build_engine(spec.engine)
    ids = [t.ids for t in engine.encode(prompts)]
    engine.close()
    adapters = ["a1" if c == "-" else c for c in choices]
    want = greedy_texts(tiny_model_dir, tiny_adapters, [(i, a, 10) for i, a in zip(ids, adapters)])
    base = greedy_texts(tiny_model_dir, tiny_adapters, [(i, None, 10) for i in ids])
    assert [rows[f"r{i}"]["result"] for i in range(6)] == want
    assert sum(w != b for w, b, a in zip(want, base, adapters) if a) >= 4  # the adapters change the answers
