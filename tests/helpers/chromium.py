"""Headless Chromium driven over its DevTools pipe, with the standard library only: open a
page, wait for its load, and evaluate JavaScript there (what a user's browser computes, shadow
DOM included, which ``--dump-dom`` leaves out)."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TIMEOUT = 120  # seconds without a message from Chromium
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,1000",
)  # fmt: skip


class Page:
    """One tab of a headless Chromium that reads its commands on fd 3 and answers on fd 4
    (``--remote-debugging-pipe``: JSON messages, each ended by a NUL byte)."""

    def __init__(self, url: str, profile: Path) -> None:
        assert CHROMIUM is not None
        cmd_r, self._cmd_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        # above 4 first, so that making them fds 3 and 4 cannot overwrite one with the other
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (cmd_r, resp_w)]
        for fd in (cmd_r, resp_w):
            os.close(fd)
        flags = " ".join(FLAGS)
        script = f"exec {CHROMIUM} {flags} --user-data-dir={profile} --remote-debugging-pipe "
        self._proc = subprocess.Popen(
            ["bash", "-c", script + f"3<&{ends[0]} 4>&{ends[1]}"],  # sh: fds up to 9 only
            pass_fds=ends,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for fd in ends:
            os.close(fd)
        self._buffer = b""
        self._id = 0
        self._session: str | None = None
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.send("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.send("Page.enable")
        self.send("Page.navigate", url=url)
        while self._message().get("method") != "Page.loadEventFired":
            pass

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Send a command; its result (events that come first are dropped)."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._cmd_w, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._message()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply["result"])

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (a promise is awaited)."""
        result = self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(str(result["exceptionDetails"]))
        return result["result"].get("value")

    def _message(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if not select.select([self._resp_r], [], [], TIMEOUT)[0]:
                raise TimeoutError(f"Chromium said nothing in {TIMEOUT} s")
            chunk = os.read(self._resp_r, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed its DevTools pipe")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        return dict(json.loads(raw))

    def close(self) -> None:
        os.close(self._cmd_w)
        os.close(self._resp_r)
        self._proc.terminate()
        self._proc.wait(timeout=30)
