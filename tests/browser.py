"""One headless Chromium for a whole test session, driven through the DevTools protocol.

Starting Chromium costs about a second and a half, most of it waiting, not computing;
the rendering tests load dozens of pages. :class:`Browser` starts it once
(``--remote-debugging-pipe``: commands on file descriptor 3, replies and events on 4,
each message JSON ended by a NUL byte) and opens each page in a tab of its own, closed
after use. Nothing goes through the network: no port is opened.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

#: Headless Chromium, if installed (Debian's package ``chromium``; ``.ci/run`` installs it).
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
#: Seconds any one reply or page load may take before the test fails.
TIMEOUT_S = 60.0


class BrowserError(RuntimeError):
    """Chromium ended, answered with an error, or did not answer in time."""


# Run before Chromium, in its process: the pipes put where it looks for them (subprocess
# keeps a file descriptor's number; ``preexec_fn`` is not safe with threads running).
_PLACE_PIPES = """
import os, sys
commands, replies = int(sys.argv[1]), int(sys.argv[2])
os.dup2(commands, 3)
os.dup2(replies, 4)
os.close(commands)
os.close(replies)
os.execv(sys.argv[3], sys.argv[3:])
"""


def _high_fd(fd: int) -> int:
    """``fd`` moved above 4, so placing the pipes at 3 and 4 in the child clobbers neither."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5)
    os.close(fd)
    return moved


class Browser:
    """A headless Chromium and its DevTools connection."""

    def __init__(self, executable: str, profile: Path) -> None:
        to_browser, self._commands = map(_high_fd, os.pipe())
        self._replies, from_browser = map(_high_fd, os.pipe())
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _PLACE_PIPES,
                str(to_browser),
                str(from_browser),
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(to_browser, from_browser),
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []

    def close(self) -> None:
        """Ask Chromium to quit, and make sure it did."""
        with contextlib.suppress(BrowserError, OSError):
            self._send("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._commands)
        os.close(self._replies)

    def _send(self, method: str, session: str | None = None, **params: Any) -> int:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        return self._next_id

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise BrowserError(f"Chromium did not answer within {TIMEOUT_S:g} s")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium ended (exit status {self.proc.wait()})")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        found: dict[str, Any] = json.loads(message)
        return found

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its reply (events meanwhile are kept)."""
        sent = self._send(method, session, **params)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            message = self._receive(deadline)
            if message.get("id") != sent:
                if "method" in message:
                    self._events.append(message)
                continue
            if "error" in message:
                raise BrowserError(f"{method}: {message['error'].get('message', message)}")
            result: dict[str, Any] = message.get("result", {})
            return result

    def wait_for(self, event: str, session: str) -> dict[str, Any]:
        """The next ``event`` of ``session``, from those kept or those still to come."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            for message in self._events:
                if message.get("method") == event and message.get("sessionId") == session:
                    self._events.remove(message)
                    return message
            self._events.append(self._receive(deadline))

    @contextlib.contextmanager
    def page(self, url: str, *, width: int, height: int) -> Iterator[str]:
        """A new tab of ``width`` by ``height`` CSS pixels with ``url`` loaded (its
        ``load`` event fired, so every inline script has run); the tab's session id."""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = ""
        try:
            reply = self.call("Target.attachToTarget", targetId=target, flatten=True)
            session = reply["sessionId"]
            self.call("Page.enable", session)
            self.resize(session, width=width, height=height)
            self.call("Page.navigate", session, url=url)
            self.wait_for("Page.loadEventFired", session)
            yield session
        finally:
            self.call("Target.closeTarget", targetId=target)
            self._events = [e for e in self._events if e.get("sessionId") != session]

    def resize(self, session: str, *, width: int, height: int) -> None:
        """Make the tab's viewport ``width`` by ``height`` CSS pixels (at one device
        pixel each)."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def evaluate(self, session: str, expression: str) -> Any:
        """The value of a JavaScript expression in the tab."""
        reply = self.call("Runtime.evaluate", session, expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression!r} raised: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def screenshot(self, session: str, path: Path) -> None:
        """Write what the tab's viewport shows to ``path`` as a PNG."""
        data = self.call("Page.captureScreenshot", session, format="png")["data"]
        path.write_bytes(base64.b64decode(data))
