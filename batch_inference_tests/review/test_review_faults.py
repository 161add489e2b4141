"""Faults around human review: the server killed mid-review, racing reviewers, requests from off loopback.

Conservation (inferred = approved + rejected + awaiting + quarantined) is recounted from
storage at the end of each.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter

import aiohttp
import pytest
import yaml

from batch_inference import review as rv
from batch_inference.pipeline import PipelineRun
from batch_inference.review.server import check_bind
from batch_inference_tests.review.helpers import TOKENS


def balanced(run: PipelineRun, r: int = 0) -> dict[str, int]:
    c = run.round_counts(r)
    assert c["inferred"] == c["approved"] + c["rejected"] + c["awaiting"] + c["judge_quarantined"], c
    assert c["pending"] == c["inferred"] + c["infer_quarantined"], c
    return c


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


async def post(s: aiohttp.ClientSession, url: str, body: dict, who: str | None = None) -> tuple[int, dict]:
    async with s.post(url, json=body, headers=auth(who) if who else {}) as resp:
        return resp.status, await resp.json()


def test_server_killed_mid_review_loses_no_verdict_and_leases_expire(review_spec, review_server, tmp_path) -> None:
    spec, spec_path = review_spec(records=10)
    reviewers = tmp_path / "reviewers.yaml"
    reviewers.write_text(yaml.safe_dump(TOKENS))
    args = ("--reviewers", str(reviewers), "--lease", "3s")
    server = review_server(spec_path, *args)

    async def before_kill() -> tuple[list[str], str]:
        decided = []
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                _, got = await post(s, server.url + "/api/next", {}, "alice")
                rid = got["record"]["id"]
                status, res = await post(s, server.url + "/api/verdict", {"round": 0, "id": rid, "verdict": "approve"}, "alice")
                assert status == 200 and res["result"] == "decided"
                decided.append(rid)
            _, held = await post(s, server.url + "/api/next", {}, "alice")  # leased to alice when the server dies
        return decided, held["record"]["id"]

    decided, held = asyncio.run(before_kill())
    server.kill()  # SIGKILL: no shutdown path runs
    t_killed = time.monotonic()
    again = review_server(spec_path, *args)

    async def after_restart() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.get(again.url + "/api/progress", headers=auth("bob")) as resp:
                p = await resp.json()
            assert p["done"] == 4 and p["left"] == 6  # every acknowledged verdict survived
            seen = []
            while True:  # bob gets everything undecided except alice's record while her lease lasts
                _, got = await post(s, again.url + "/api/next", {"skip": seen}, "bob")
                if got["record"] is None:
                    break
                seen.append(got["record"]["id"])
            if time.monotonic() - t_killed < 3:
                assert held not in seen and len(seen) == 5
            for rid in seen:
                await post(s, again.url + "/api/release", {"round": 0, "id": rid}, "bob")
            await asyncio.sleep(max(0.0, 3.2 - (time.monotonic() - t_killed)))
            # alice's lease expired: the record is free for bob now
            rest = []
            while (got := (await post(s, again.url + "/api/next", {}, "bob"))[1]["record"]) is not None:
                await post(s, again.url + "/api/verdict", {"round": 0, "id": got["id"], "verdict": "reject", "reason": "bad"}, "bob")
                rest.append(got["id"])
            assert held in rest and len(rest) == 6 and not set(rest) & set(decided)

    asyncio.run(after_restart())
    run = PipelineRun(spec)
    f = rv.fold(rv.ReviewLog(run.layout, 0, None).entries())
    assert len(f.decided) == 10 and not f.conflicts
    assert Counter(e["reviewer"] for e in f.decided.values()) == {"alice": 4, "bob": 6}
    assert rv.ReviewLog(run.layout, 0, None).leases() == {}  # every lease released by its verdict
    asyncio.run(run.resolve_review(0))
    c = balanced(run)
    assert (c["approved"], c["rejected"], c["awaiting"]) == (4, 6, 0)


def test_two_reviewers_racing_never_decide_a_record_twice(review_spec, review_server, tmp_path) -> None:
    spec, spec_path = review_spec(records=40)
    reviewers = tmp_path / "reviewers.yaml"
    reviewers.write_text(yaml.safe_dump(TOKENS))
    server = review_server(spec_path, "--reviewers", str(reviewers))

    async def reviewer(s: aiohttp.ClientSession, name: str, shown: list[str]) -> None:
        while True:
            _, got = await post(s, server.url + "/api/next", {}, name)
            if got["record"] is None:
                return
            shown.append(got["record"]["id"])
            status, res = await post(s, server.url + "/api/verdict",
                                     {"round": 0, "id": got["record"]["id"], "verdict": "approve"}, name)
            assert status == 200 and res["result"] == "decided", res

    async def race() -> dict[str, list[str]]:
        shown: dict[str, list[str]] = {name: [] for name in TOKENS}
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(reviewer(s, name, out) for name, out in shown.items()))
        return shown

    shown = asyncio.run(race())
    every = [rid for ids in shown.values() for rid in ids]
    assert len(every) == 40 and len(set(every)) == 40  # no record shown to two reviewers
    run = PipelineRun(spec)
    f = rv.fold(rv.ReviewLog(run.layout, 0, None).entries())
    assert len(f.decided) == 40 and not f.conflicts
    asyncio.run(run.resolve_review(0))
    assert balanced(run)["approved"] == 40


def test_off_loopback_needs_a_token(review_spec, review_server, tmp_path) -> None:
    spec, spec_path = review_spec(records=4)
    with pytest.raises(PermissionError, match="off loopback"):
        check_bind("0.0.0.0", None)
    refused = subprocess.run([sys.executable, "-m", "batch_inference.cli.main", "review", str(spec_path), "--host", "0.0.0.0"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "refusing to bind 0.0.0.0" in refused.stderr
    reviewers = tmp_path / "reviewers.yaml"
    reviewers.write_text(yaml.safe_dump(TOKENS))
    server = review_server(spec_path, "--host", "0.0.0.0", "--reviewers", str(reviewers))
    port = server.url.rsplit(":", 1)[1]
    host = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    addresses = [h for h in host if "." in h and not h.startswith("127.")] or ["127.0.0.1"]
    base = f"http://{addresses[0]}:{port}"

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/api/progress") as resp:
                assert resp.status == 401
            async with s.post(base + "/api/next", json={}) as resp:
                assert resp.status == 401
            async with s.post(base + "/api/verdict", json={"round": 0, "id": "x", "verdict": "approve"},
                              headers={"Authorization": "Bearer not-a-reviewer-token"}) as resp:
                assert resp.status == 401
            async with s.get(base + "/api/progress", headers=auth("bob")) as resp:
                assert resp.status == 200 and (await resp.json())["you"] == "bob"
            # a cross-site form post (not JSON) is refused even with a token
            async with s.post(base + "/api/next", data="x=1", headers={**auth("bob"), "Content-Type": "text/plain"}) as resp:
                assert resp.status == 415

    asyncio.run(go())
    run = PipelineRun(spec)
    assert rv.ReviewLog(run.layout, 0, None).entries() == []  # nothing refused reached the log
    assert balanced(run)["awaiting"] == 4


@pytest.mark.process
def test_a_tokenless_server_answers_nothing_from_off_loopback(review_spec) -> None:
    """Defence in depth: even bound to every address by mistake (check_bind bypassed), no tokens = loopback only."""
    from batch_inference.review.server import start

    spec, _ = review_spec(records=2)
    host = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    addresses = [h for h in host if "." in h and not h.startswith("127.")]
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address to come from")

    async def go() -> None:
        runner, port = await start(rv.ReviewQueue(spec), "0.0.0.0", 0, default_reviewer="mallory")
        try:
            async with aiohttp.ClientSession() as s:
                for path in ("/api/progress", "/"):
                    async with s.get(f"http://{addresses[0]}:{port}{path}") as resp:
                        assert resp.status == 403, path
                async with s.post(f"http://{addresses[0]}:{port}/api/next", json={}) as resp:
                    assert resp.status == 403
                async with s.get(f"http://127.0.0.1:{port}/api/progress") as resp:  # loopback still works
                    assert resp.status == 200 and (await resp.json())["you"] == "mallory"
                async with s.get(f"http://127.0.0.1:{port}/api/progress", headers={"Host": "evil.example"}) as resp:
                    assert resp.status == 403  # DNS rebinding: a loopback server answers loopback names only
        finally:
            await runner.cleanup()

    asyncio.run(go())
    assert rv.ReviewLog(PipelineRun(spec).layout, 0, None).entries() == []
    assert balanced(PipelineRun(spec))["awaiting"] == 2


def test_review_a_run_by_its_url(review_spec, review_server) -> None:
    """`batch-inference review <output>/<run>` reads the spec the run recorded in its ledger."""
    spec, _ = review_spec(records=3)
    server = review_server(f"{spec.output}/{spec.run}", "--as", "uma")

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/health") as resp:
                assert (await resp.json()) == {"ok": True, "run": spec.run, "rounds": [0]}
            status, got = await post(s, server.url + "/api/next", {})
            assert status == 200 and got["record"]["round"] == 0

    asyncio.run(go())
    refused = subprocess.run([sys.executable, "-m", "batch_inference.cli.main", "review", f"{spec.output}/no-such-run"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "neither a spec file nor a started run" in refused.stderr
