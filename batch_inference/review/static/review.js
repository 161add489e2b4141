// The review page: one record at a time, keyboard verdicts. Every value from the server is
// shown with textContent (never innerHTML): model output is untrusted text.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const hash = new URLSearchParams(location.hash.slice(1));
  const query = new URLSearchParams(location.search);
  if (hash.get("token")) sessionStorage.setItem("review-token", hash.get("token"));
  const token = sessionStorage.getItem("review-token");
  let current = null;
  let skipped = [];
  let busy = false;
  function setBusy(value) {  // also tells a test driver (or a screen reader) when keys are taken again
    busy = value;
    document.body.dataset.busy = value ? "1" : "0";
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (token) h.Authorization = "Bearer " + token;
    return h;
  }
  async function api(path, body) {
    const opts = body === undefined ? { headers: headers() } : { method: "POST", headers: headers(), body: JSON.stringify(body) };
    const res = await fetch(path, opts);
    const data = await res.json().catch(() => ({ error: res.statusText }));
    if (!res.ok) throw new Error(data.error || res.statusText);
    return data;
  }
  function say(text, isError) {
    $("status").textContent = text;
    $("status").className = isError ? "error" : "";
  }
  function text(el, value) {
    el.textContent = value === null || value === undefined ? "" : typeof value === "string" ? value : JSON.stringify(value, null, 2);
  }
  function item(list, value) {
    const li = document.createElement("li");
    li.textContent = value;
    list.appendChild(li);
  }
  function filters() {
    return { round: $("round").value || null, reason: $("reason").value || null };
  }
  function duration(s) {
    if (s === null || s === undefined) return "–";
    if (s < 90) return Math.round(s) + " s";
    if (s < 5400) return Math.round(s / 60) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function setOptions(select, values, label) {
    const keep = select.value;
    while (select.options.length > 1) select.remove(1);
    for (const v of values) {
      const o = document.createElement("option");
      o.value = String(v);
      o.textContent = label(v);
      select.appendChild(o);
    }
    select.value = keep;
  }

  function show(rec) {
    current = rec;
    $("card").hidden = !rec;
    $("empty").hidden = !!rec;
    if (!rec) return;
    text($("rid"), rec.key || rec.id);  // the key: "a#2" for the second record with id "a"
    text($("rround"), String(rec.round));
    text($("rattempts"), rec.attempts === undefined ? "" : String(rec.attempts));
    text($("prompt"), rec.prompt);
    const msgs = $("messages");
    msgs.replaceChildren();
    for (const m of rec.messages || []) item(msgs, (m && m.role ? m.role + ": " : "") + (m && m.content !== undefined ? (typeof m.content === "string" ? m.content : JSON.stringify(m.content)) : JSON.stringify(m)));
    text($("result"), rec.result);
    const v = rec.verdict;
    text($("auto"), v ? (v.approved ? "approved" : "not approved") + (v.reason ? " — " + v.reason : "") + (v.score !== null && v.score !== undefined ? " (score " + v.score + ")" : "") : "none");
    const earlier = $("earlier");
    earlier.replaceChildren();
    for (const e of rec.earlier || []) item(earlier, "round " + e.round + ": " + (e.result === null ? "error " + (e.error || "") : e.result) + (e.rejection ? "  [" + e.rejection + "]" : ""));
    if (!(rec.earlier || []).length) item(earlier, "none");
    text($("fields"), rec.record);
    text($("lease"), "until " + new Date(rec.lease.expires_at * 1000).toLocaleTimeString());
    $("why").value = "";
    $("edit").value = "";
  }

  async function next() {
    try {
      const data = await api("/api/next", { ...filters(), skip: skipped });
      show(data.record);
      if (!data.record) $("empty-why").textContent = skipped.length ? "(" + skipped.length + " skipped this session)" : "";
    } catch (err) {
      say(err.message, true);
    }
    progress();
  }

  async function progress() {  // the header; returns the figures (null when the server did not answer)
    try {
      const f = filters();
      const q = new URLSearchParams();
      if (f.round) q.set("round", f.round);
      if (f.reason) q.set("reason", f.reason);
      const p = await api("/api/progress?" + q.toString());
      text($("run"), p.run);
      text($("done"), String(p.done));
      text($("left"), String(p.left));
      text($("rate"), String(p.rate_per_hour));
      text($("eta"), duration(p.eta_s));
      text($("you"), "you: " + p.you);
      setOptions($("round"), p.rounds.map((r) => r.round), (r) => "r" + String(r).padStart(2, "0"));
      setOptions($("reason"), Object.keys(p.reasons), (r) => (r || "(none)") + " (" + p.reasons[r] + ")");
      const per = $("per-reviewer");
      per.replaceChildren();
      for (const [name, n] of Object.entries(p.per_reviewer)) item(per, name + ": " + n);
      return p;
    } catch (err) {
      say(err.message, true);
      return null;
    }
  }

  async function poll() {  // new work (a round opened, a lease expired) is fetched without a key or a reload
    const p = await progress();
    if (p && !current && !busy && p.left > skipped.length) {
      setBusy(true);
      try {
        await next();
      } finally {
        setBusy(false);
      }
    }
  }

  async function decide(verdict) {
    if (!current || busy) return;
    setBusy(true);
    const rec = current;
    try {
      const edit = $("edit").value;
      const res = await api("/api/verdict", { round: rec.round, key: rec.key, verdict: verdict, reason: $("why").value || null, edited_result: edit ? edit : null });
      say(res.result === "conflict" ? "already decided by " + res.kept.reviewer + ": your verdict is kept in the log as a conflict" : (verdict === "approve" ? "approved " : "rejected ") + rec.key);
      await next();
    } catch (err) {
      say(err.message, true);
    } finally {
      setBusy(false);
    }
  }

  async function skip() {
    if (!current || busy) return;
    setBusy(true);
    try {
      skipped.push(current.key);
      await api("/api/release", { round: current.round, key: current.key });
      say("skipped " + current.key);
      await next();
    } catch (err) {
      say(err.message, true);
    } finally {
      setBusy(false);
    }
  }

  async function undo() {
    if (busy) return;
    setBusy(true);
    try {
      const data = await api("/api/undo", {});
      if (data.record) {
        skipped = skipped.filter((key) => key !== data.record.key);
        show(data.record);
        say("undone: " + data.record.key + " is yours again");
      } else say("nothing to undo");
      await progress();
    } catch (err) {
      say(err.message, true);
    } finally {
      setBusy(false);
    }
  }

  document.addEventListener("keydown", (ev) => {
    const typing = ev.target instanceof HTMLInputElement || ev.target instanceof HTMLTextAreaElement || ev.target instanceof HTMLSelectElement;
    if (ev.key === "Escape") {
      if (document.activeElement) document.activeElement.blur();
      return;
    }
    if (typing || ev.ctrlKey || ev.metaKey || ev.altKey) return;
    const actions = { a: () => decide("approve"), r: () => decide("reject"), s: skip, u: undo,
                      w: () => $("why").focus(), e: () => $("edit").focus() };
    const act = actions[ev.key];
    if (act) {
      ev.preventDefault();
      act();
    }
  });
  $("approve").addEventListener("click", () => decide("approve"));
  $("reject").addEventListener("click", () => decide("reject"));
  $("skip").addEventListener("click", skip);
  $("undo").addEventListener("click", undo);
  $("round").addEventListener("change", () => { skipped = []; next(); });
  $("reason").addEventListener("change", () => { skipped = []; next(); });
  if (query.get("round")) {
    const o = document.createElement("option");
    o.value = query.get("round");
    o.textContent = "r" + query.get("round").padStart(2, "0");
    $("round").appendChild(o);
    $("round").value = query.get("round");
  }
  setInterval(poll, 5000);
  next();
})();
