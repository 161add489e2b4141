"""Headless Chromium driven over the DevTools protocol (a websocket, spoken with aiohttp).

Debian's ``chromium`` package, started the way CI starts it: headless, no sandbox (CI
runs as root), no GPU, no background networking, a fresh profile; the DevTools port is
read from the profile's ``DevToolsActivePort`` file. Enough of the protocol for the
review tests: navigate, evaluate, press keys, take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", "--window-size=1200,1100", "--remote-debugging-port=0"]


class Browser:
    """One headless Chromium with one page; ``async with Browser() as b: await b.goto(url)``."""

    def __init__(self) -> None:
        if CHROMIUM is None:
            raise RuntimeError("chromium is not installed (apt-get install -y chromium chromium-driver)")
        self.profile = tempfile.mkdtemp(prefix="bi-chromium-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.ids = itertools.count(1)
        self.waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.console: list[dict[str, Any]] = []
        self.reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Browser:
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit {self.proc.poll()})")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            pages = [t for t in await resp.json() if t["type"] == "page"]
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=64 * 1024 * 1024)
        self.reader = asyncio.create_task(self._read())
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.reader is not None:
            self.reader.cancel()
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    async def _read(self) -> None:
        assert self.ws is not None
        async for msg in self.ws:
            data = msg.json()
            if "id" in data and data["id"] in self.waiters:
                self.waiters.pop(data["id"]).set_result(data)
            elif data.get("method") in ("Runtime.consoleAPICalled", "Runtime.exceptionThrown", "Log.entryAdded"):
                self.console.append(data)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        assert self.ws is not None
        i = next(self.ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiters[i] = fut
        await self.ws.send_json({"id": i, "method": method, "params": params})
        data = await asyncio.wait_for(fut, 60)
        if "error" in data:
            raise RuntimeError(f"{method}: {data['error']}")
        return data.get("result", {})

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def eval(self, expression: str) -> Any:
        res = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {expression}")
            await asyncio.sleep(0.05)

    async def press(self, key: str) -> None:
        """A printable key, as a person types it (keydown with its text, then keyup)."""
        code = f"Key{key.upper()}" if key.isalpha() else key
        vk = ord(key.upper()) if len(key) == 1 else 0
        await self.send("Input.dispatchKeyEvent", type="keyDown", key=key, code=code, text=key, windowsVirtualKeyCode=vk)
        await self.send("Input.dispatchKeyEvent", type="keyUp", key=key, code=code, windowsVirtualKeyCode=vk)

    async def screenshot(self, path: Path) -> None:
        data = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))
