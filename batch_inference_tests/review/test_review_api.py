"""The review server's HTTP API, called as docs/review.md ("The HTTP API") documents it.

Each endpoint, its request and answer shapes and its errors, over real HTTP against
`batch-inference review` as a process (aiohttp as the client). The input repeats an id
(`a, b, a`), so records are named by their key.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import yaml

from batch_inference import review as rv
from batch_inference.pipeline import PipelineRun
from batch_inference_tests.review.helpers import TOKENS

PROGRESS = {"run", "you", "lease_s", "done", "left", "per_reviewer", "verdicts", "rate_per_hour", "eta_s", "rounds", "reasons"}
RECORD = {"round", "id", "key", "prompt", "messages", "result", "verdict", "attempts", "earlier", "record", "lease"}
ENTRY = {"entry", "kind", "id", "key", "round", "verdict", "reason", "edited_result", "reviewer", "at_ns"}
JSON = {"Content-Type": "application/json"}


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


async def call(s: aiohttp.ClientSession, method: str, url: str, body: Any = None, *, who: str | None = "alice",
               headers: dict[str, str] | None = None, raw: bytes | None = None) -> tuple[int, Any]:
    """One request; the answer must be JSON whatever its status."""
    h = {**(auth(who) if who else {}), **(JSON if method == "POST" else {}), **(headers or {})}
    data = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
    async with s.request(method, url, data=data, headers=h) as resp:
        assert resp.content_type == "application/json", (resp.status, await resp.text())
        return resp.status, await resp.json()


def test_every_documented_endpoint_answers_as_documented(review_spec, review_server, tmp_path) -> None:
    src = tmp_path / "input.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": rid, "prompt": f"question {n}", "topic": "t"}) + b"\n"
                             for n, rid in enumerate("aba")))
    spec, spec_path = review_spec(records=3)
    reviewers = tmp_path / "reviewers.yaml"
    reviewers.write_text(yaml.safe_dump(TOKENS))
    server = review_server(spec_path, "--reviewers", str(reviewers))
    api = server.url + "/api"

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            assert await call(s, "GET", server.url + "/health", who=None) == (200, {"ok": True, "run": spec.run, "rounds": [0]})
            # who you are: the token, on every /api/ call
            status, err = await call(s, "GET", api + "/progress", who=None)
            assert status == 401 and "token" in err["error"]
            status, p = await call(s, "GET", api + "/progress?round=0")
            assert status == 200 and set(p) == PROGRESS
            assert (p["you"], p["done"], p["left"], p["run"], p["eta_s"]) == ("alice", 0, 3, spec.run, None)
            assert p["rounds"] == [{"round": 0, "total": 3, "done": 0, "left": 3, "conflicts": 0}]
            assert sum(p["reasons"].values()) == 3
            # posts: JSON, same origin
            assert (await call(s, "POST", api + "/next", raw=b"{}", headers={"Content-Type": "text/plain"}))[0] == 415
            assert (await call(s, "POST", api + "/next", {}, headers={"Origin": "http://evil.example"}))[0] == 403
            assert (await call(s, "POST", api + "/next", raw=b"[1]"))[0] == 400
            assert (await call(s, "POST", api + "/next", {"skip": "a"}))[0] == 400
            assert (await call(s, "POST", api + "/next", raw=b"{" + b" " * 300_000 + b"}"))[0] == 413

            # next: a record leased to you, named by its key
            status, got = await call(s, "POST", api + "/next", {"round": 0})
            rec = got["record"]
            assert status == 200 and set(rec) == RECORD and set(rec["lease"]) == {"token", "expires_at", "reviewer"}
            assert rec["lease"]["reviewer"] == "alice" and rec["record"]["topic"] == "t" and rec["prompt"].startswith("question")
            keys = {rec["key"]: rec}
            while (got := (await call(s, "POST", api + "/next", {"round": 0, "skip": list(keys)}))[1])["record"]:
                keys[got["record"]["key"]] = got["record"]
            assert sorted(keys) == ["a", "a#2", "b"] and [keys[k]["id"] for k in sorted(keys)] == ["a", "a", "b"]
            assert (await call(s, "POST", api + "/next", {"round": 0}, who="bob"))[1] == {"record": None}  # alice holds all 3
            assert await call(s, "POST", api + "/release", {"round": 0, "key": "a#2"}) == (200, {"ok": True})
            assert (await call(s, "POST", api + "/next", {"round": 0}, who="bob"))[1]["record"]["key"] == "a#2"

            # verdict: the errors first
            for bad in ({"round": 0, "key": "a", "verdict": "maybe"}, {"key": "a", "verdict": "approve"},
                        {"round": 0, "verdict": "approve"}, {"round": "x", "key": "a", "verdict": "approve"},
                        {"round": 0, "key": "a", "verdict": "reject", "reason": 3}):
                status, err = await call(s, "POST", api + "/verdict", bad)
                assert status == 400 and isinstance(err["error"], str), (bad, status, err)
            status, err = await call(s, "POST", api + "/verdict", {"round": 0, "key": "zz", "verdict": "approve"})
            assert status == 404 and "zz" in err["error"]
            status, err = await call(s, "POST", api + "/verdict", {"round": 5, "key": "a", "verdict": "approve"})
            assert status == 409
            # decided, then a conflict; `id` stands for the key where no key is given
            status, res = await call(s, "POST", api + "/verdict", {"round": 0, "key": "a#2", "verdict": "reject", "reason": "off topic"}, who="bob")
            assert status == 200 and res["result"] == "decided" and res["kept"] is None and set(res["entry"]) == ENTRY
            assert (res["entry"]["id"], res["entry"]["key"], res["entry"]["reviewer"]) == ("a", "a#2", "bob")
            status, res = await call(s, "POST", api + "/verdict", {"round": 0, "key": "a#2", "verdict": "approve"})
            assert status == 200 and res["result"] == "conflict" and res["kept"]["reviewer"] == "bob"
            status, res = await call(s, "POST", api + "/verdict", {"round": 0, "id": "b", "verdict": "approve", "edited_result": "better"})
            assert res["result"] == "decided" and res["entry"]["key"] == "b" and res["entry"]["edited_result"] == "better"
            # undo: the latest standing verdict comes back, leased to you; none: null
            status, undone = await call(s, "POST", api + "/undo", {})
            assert status == 200 and undone["record"]["key"] == "b" and undone["record"]["lease"]["reviewer"] == "alice"
            assert await call(s, "POST", api + "/undo", {}, who="carol") == (200, {"record": None})
            for key, verdict in (("b", "approve"), ("a", "approve")):
                assert (await call(s, "POST", api + "/verdict", {"round": 0, "key": key, "verdict": verdict}))[1]["result"] == "decided"
            _, p = await call(s, "GET", api + "/progress")
            assert (p["done"], p["left"], p["per_reviewer"], p["verdicts"]) == (3, 0, {"alice": 2, "bob": 1}, {"approve": 2, "reject": 1})
            assert (await call(s, "GET", api + "/nope"))[0] == 404
            assert (await call(s, "GET", api + "/verdict"))[0] == 405

            # the round closes: a verdict or an undo is refused, 409
            await asyncio.to_thread(lambda: asyncio.run(PipelineRun(spec).resolve_review(0)))
            # (an undo: 409 while the server still holds the round, {"record": null} once its refresh dropped it)
            status, res = await call(s, "POST", api + "/undo", {})
            assert (status, res.get("record", "-")) in ((409, "-"), (200, None)), (status, res)
            status, err = await call(s, "POST", api + "/verdict", {"round": 0, "key": "a", "verdict": "reject"}, who="bob")
            assert status == 409 and "round 0" in err["error"]

    asyncio.run(go())
    f = rv.fold(rv.ReviewLog(PipelineRun(spec).layout, 0, None).entries())
    assert sorted(f.decided) == ["a", "a#2", "b"] and len(f.conflicts) == 1 and f.undone == 1
