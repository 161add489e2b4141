"""One-off: screenshot the Dagster asset graph for the README (docs/asset-graph.png).

Runs the demo into a temporary Dagster home, serves it with ``dagster dev`` on loopback,
drives headless Chromium (Debian's ``chromium``) over the DevTools protocol to dismiss
the first-visit dialog and hide the navigation, saves a PNG, and stops both by
process group. Not part of the test suite::

    apt-get install -y chromium
    .venv/bin/python docs/screenshot.py [OUT.png]
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
WIDTH, HEIGHT = int(os.environ.get("WIDTH", "2200")), int(os.environ.get("HEIGHT", "1150"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            preexec_fn=default_signals, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_http(url: str, timeout: float, data: bytes | None = None) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.read()
        except OSError:
            time.sleep(1)
    raise TimeoutError(url)


JS_DISMISS = """(() => { for (const b of document.querySelectorAll('button'))
  if (b.textContent.trim() === 'Skip') { b.click(); return 'dismissed'; } return 'no dialog'; })()"""
JS_HIDE_NAV = """(() => { let n = 0; for (const b of document.querySelectorAll('button, a, div[role=button]'))
  if (b.textContent.trim() === 'Hide navigation') { b.click(); n++; }
  const jump = document.querySelector('input[placeholder^="Jump to"]');
  const all = [...document.querySelectorAll('button')];
  const next = jump && all.find(b => jump.compareDocumentPosition(b) & Node.DOCUMENT_POSITION_FOLLOWING);
  if (next) { next.click(); n++; }
  return n; })()"""


JS_ZOOM_IN = """(() => { const icon = document.querySelector('[aria-label="zoom_in"]');
  const b = icon && icon.closest('button'); if (b) { b.click(); return true; } return false; })()"""


async def capture(debug_port: int, url: str, out: Path) -> None:
    targets = json.loads(wait_http(f"http://127.0.0.1:{debug_port}/json/list", 30))
    ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        counter = 0

        async def call(method: str, **params):
            nonlocal counter
            counter += 1
            await ws.send_json({"id": counter, "method": method, "params": params})
            async for msg in ws:
                data = json.loads(msg.data)
                if data.get("id") == counter:
                    return data.get("result", {})
            raise RuntimeError("devtools connection closed")

        async def js(expr: str):
            return (await call("Runtime.evaluate", expression=expr, returnByValue=True)).get("result", {}).get("value")

        await call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False)
        await call("Page.navigate", url=url)
        await asyncio.sleep(10)
        print("dialog:", await js(JS_DISMISS))
        await asyncio.sleep(2)
        print("navigation hidden:", await js(JS_HIDE_NAV))
        await asyncio.sleep(2)
        for _ in range(int(os.environ.get("ZOOM_IN", "0"))):  # enough to show each node's details
            print("zoomed in:", await js(JS_ZOOM_IN))
            await asyncio.sleep(1)
        await asyncio.sleep(4)
        shot = await call("Page.captureScreenshot", format="png")
        out.write_bytes(base64.b64decode(shot["data"]))


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "asset-graph.png").resolve()
    page = os.environ.get("PAGE", "locations/batch_inference/asset-groups/batch_inference")
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        sys.exit("no chromium on PATH (apt-get install -y chromium)")
    tmp = Path(tempfile.mkdtemp(prefix="bi-shot-"))
    procs: list[subprocess.Popen] = []
    try:
        subprocess.run([str(VENV_BIN / "batch-inference"), "demo", "--dir", str(tmp / "demo"), "--records", "200"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        home = tmp / "demo" / "dagster_home"
        shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        port, debug_port = free_port(), free_port()
        env = {**os.environ, "DAGSTER_HOME": str(home), "BATCH_INFERENCE_POOL_MODE": "inprocess"}
        procs.append(start([str(VENV_BIN / "dagster"), "dev", "-h", "127.0.0.1", "-p", str(port), "-w", "workspace.yaml"],
                           env, tmp / "dev.log"))
        wait_http(f"http://127.0.0.1:{port}/graphql", 180, data=b'{"query": "{ version }"}')
        procs.append(start([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                            "--disable-background-networking", "--disable-component-update", "--disable-sync",
                            "--hide-scrollbars", f"--user-data-dir={tmp / 'chromium'}", f"--window-size={WIDTH},{HEIGHT}",
                            f"--remote-debugging-port={debug_port}", "about:blank"], dict(os.environ), tmp / "chromium.log"))
        asyncio.run(capture(debug_port, f"http://127.0.0.1:{port}/{page}", out))
        print(f"wrote {out}")
    finally:
        for proc in reversed(procs):
            stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
