"""The real review page in headless Chromium, driven with the keyboard (DevTools protocol)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml

from batch_inference import review as rv
from batch_inference.pipeline import PipelineRun
from batch_inference.storage import JsonlDir
from batch_inference_tests.review.cdp import CHROMIUM, Browser
from batch_inference_tests.review.helpers import TOKENS

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
# The screenshot the docs show (docs/review-page.png) is refreshed with
#   BATCH_INFERENCE_SCREENSHOT=docs/review-page.png .venv/bin/python -m pytest batch_inference_tests/review -k keyboard
# (a plain test run writes it under tmp, so `make test` leaves the tree clean).
SCREENSHOT_ENV = "BATCH_INFERENCE_SCREENSHOT"

SHOWN = ("document.body.dataset.busy === '1' || document.getElementById('card').hidden ? '' : "
         "document.getElementById('rid').textContent")
EMPTY = "document.body.dataset.busy !== '1' && !document.getElementById('empty').hidden"


def balanced(run: PipelineRun, r: int) -> dict[str, int]:
    c = run.round_counts(r)
    assert c["inferred"] == c["approved"] + c["rejected"] + c["awaiting"] + c["judge_quarantined"], c
    return c


async def shows_next(b: Browser, before: str) -> str:
    """Wait until the page shows another record (or says the queue is done); returns its id."""
    return await b.wait_for(f"(({SHOWN}) !== {json.dumps(before)} && ({SHOWN})) || ({EMPTY} && '<empty>')")


def test_review_a_round_with_the_keyboard(review_spec, review_server, tmp_path) -> None:
    spec, spec_path = review_spec(records=6, max_rounds=2)
    reviewers = tmp_path / "reviewers.yaml"
    reviewers.write_text(yaml.safe_dump(TOKENS))
    server = review_server(spec_path, "--reviewers", str(reviewers))
    shot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "review-page.png")

    async def go() -> list[str]:
        keys: list[str] = []
        async with Browser() as b:
            await b.goto(f"{server.url}/#token={TOKENS['alice']}")
            rid = await b.wait_for(SHOWN)
            assert await b.wait_for("document.getElementById('you').textContent") == "you: alice"
            # a, r, then undo the reject (the record comes back), decide it again, s skips one
            plan = ["a", "r", "u", "a", "s", "a", "r", "a", "a"]
            for key in plan:
                if rid == "<empty>":
                    break
                if key == "r":  # a reason typed in the field, then Esc back to the keys
                    await b.press("w")
                    await b.send("Input.insertText", text="off topic")
                    await b.send("Input.dispatchKeyEvent", type="keyDown", key="Escape", code="Escape", windowsVirtualKeyCode=27)
                await b.press(key)
                keys.append(key)
                rid = await shows_next(b, rid)
                if len(keys) == 2:  # what a reviewer sees mid-round (docs/review.md)
                    await b.wait_for("document.getElementById('done').textContent === '2'")
                    await b.screenshot(shot)
            # the skipped record is still waiting: a fresh page (skip list gone) gets it
            await b.goto(f"{server.url}/?round=0#token={TOKENS['alice']}")
            rid = await b.wait_for(f"({SHOWN}) || ({EMPTY} && '<empty>')")
            while rid != "<empty>":
                await b.press("a")
                rid = await shows_next(b, rid)
            done = await b.wait_for("document.getElementById('left').textContent === '0' && document.getElementById('done').textContent")
            assert done == "6"
            assert not [c for c in b.console if c.get("method") == "Runtime.exceptionThrown"]
        return keys

    keys = asyncio.run(go())
    assert "u" in keys and "s" in keys
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    run = PipelineRun(spec)
    log = rv.ReviewLog(run.layout, 0, None)
    entries = log.entries()
    f = rv.fold(entries)
    assert len(f.decided) == 6 and not f.conflicts and f.undone == 1
    assert {e["reviewer"] for e in entries} == {"alice"}
    rejected = [e for e in f.decided.values() if e["verdict"] == "reject"]
    assert rejected and all(e["reason"] == "off topic" for e in rejected)
    assert len(log.segment_names()) == len(entries)  # one durable segment per verdict / undo
    summary = asyncio.run(run.resolve_review(0))
    assert summary.by_reviewer == {"alice": 6}
    assert run.decide(0).kind == "next_round"  # the people's rejections go to round 1
    assert balanced(run, 0)["rejected"] == len(rejected)


def test_xss_payloads_in_model_output_are_inert(review_spec, review_server, tmp_path) -> None:
    payloads = ['<script>window.__xss = 1</script>', '<img src=x onerror="window.__xss = 2">',
                '<a href="javascript:window.__xss = 3" id="xss-link">click</a>']
    src = tmp_path / "input.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": f"x{i}", "prompt": p}) + b"\n" for i, p in enumerate(payloads)))
    spec, spec_path = review_spec(records=3)
    run = PipelineRun(spec)
    # a model whose output is the payload: rewrite the queued results as such a model would have written them
    for shard in JsonlDir(run.layout.review_queue(0)).shards():
        rows = list(shard.iter_records_sync())
        with shard.writer_sync() as w:
            w.write_many([{**row, "result": payloads[int(row["id"][1:])] + " javascript:alert(1)"} for row in rows])
    server = review_server(spec_path, "--as", "carol")

    async def go() -> None:
        async with aiohttp.ClientSession() as s, s.get(server.url + "/") as resp:
            csp = resp.headers["Content-Security-Policy"]
            assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
        async with Browser() as b:
            await b.goto(server.url + "/")
            seen = set()
            rid = await b.wait_for(SHOWN)
            while rid != "<empty>":
                seen.add(rid)
                i = int(rid[1:])
                assert await b.eval("document.getElementById('result').textContent") == payloads[i] + " javascript:alert(1)"
                assert await b.eval("document.getElementById('prompt').textContent") == payloads[i]
                assert await b.eval("document.querySelectorAll('#card pre *, #card li *').length") == 0
                assert await b.eval("document.getElementById('xss-link') === null && typeof window.__xss === 'undefined'")
                await b.press("r")
                rid = await shows_next(b, rid)
            assert seen == {"x0", "x1", "x2"}
            await asyncio.sleep(0.3)  # an onerror would have fired by now
            assert await b.eval("typeof window.__xss === 'undefined'")

    asyncio.run(go())
    f = rv.fold(rv.ReviewLog(run.layout, 0, None).entries())
    assert len(f.decided) == 3 and {e["reviewer"] for e in f.decided.values()} == {"carol"}
    asyncio.run(run.resolve_review(0))
    assert balanced(run, 0)["rejected"] == 3


def test_the_page_picks_up_a_newly_opened_round_by_itself(review_spec, review_server, tmp_path) -> None:
    """The page says nothing is left; round 1's queue opens; a record appears without a key or a reload."""
    from batch_inference.pipeline.runner import open_runner

    spec, spec_path = review_spec(records=2, max_rounds=3)
    server = review_server(spec_path, "--as", "dave")

    async def go() -> str:
        async with Browser() as b:
            await b.goto(server.url + "/")
            rid = await b.wait_for(SHOWN)
            while rid != "<empty>":
                await b.press("r")
                rid = await shows_next(b, rid)
            run = PipelineRun(spec)
            await run.resolve_review(0)
            assert run.decide(0).kind == "next_round"
            async with open_runner(spec) as runner:
                nxt = PipelineRun(spec, runner)
                await nxt.recompact(0)
                await nxt.infer(1)
                await nxt.judge(1)
            # the server's refresher and the page's poll each run every 5 s: no key is pressed
            shown = await b.wait_for(SHOWN, timeout_s=30)
            assert await b.eval("document.getElementById('rround').textContent") == "1"
            assert await b.wait_for("document.getElementById('left').textContent === '2'")
            assert not [c for c in b.console if c.get("method") == "Runtime.exceptionThrown"]
            return shown

    assert asyncio.run(go())


def test_duplicate_ids_are_each_decided_with_the_keyboard_and_the_round_closes(review_spec, review_server, tmp_path) -> None:
    """Ids a, b, a (duplicates are kept): each of the three rows is shown and decided, so the
    round closes under the default policy (wait for people), which waited forever on one."""
    src = tmp_path / "input.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": rid, "prompt": f"question {n}"}) + b"\n" for n, rid in enumerate("aba")))
    spec, spec_path = review_spec(records=3)
    assert spec.review.after is None
    run = PipelineRun(spec)
    assert run.review_status(0).left == 3
    server = review_server(spec_path, "--as", "erin")

    async def go() -> list[tuple[str, str]]:
        shown = []
        async with Browser() as b:
            await b.goto(server.url + "/")
            rid = await b.wait_for(SHOWN)
            while rid != "<empty>":
                shown.append((rid, await b.eval("document.getElementById('prompt').textContent")))
                await b.press("r" if len(shown) == 2 else "a")
                rid = await shows_next(b, rid)
            assert await b.wait_for("document.getElementById('left').textContent === '0' && document.getElementById('done').textContent") == "3"
            assert not [c for c in b.console if c.get("method") == "Runtime.exceptionThrown"]
        return shown

    shown = asyncio.run(go())
    assert sorted(shown) == [("a", "question 0"), ("a#2", "question 2"), ("b", "question 1")]
    st = run.review_status(0)
    assert (st.decided, st.left, st.resolvable) == (3, 0, True)
    summary = asyncio.run(run.resolve_review(0))
    assert (summary.records, summary.approved, summary.rejected, summary.by_reviewer) == (3, 2, 1, {"erin": 3})
    c = balanced(run, 0)
    assert (c["approved"], c["rejected"], c["awaiting"]) == (2, 1, 0)
    approved = sorted((r["id"], r["prompt"]) for r in JsonlDir(run.layout.results).iter_records_sync())
    assert approved == sorted((key.split("#")[0], prompt) for key, prompt in (shown[0], shown[2]))
