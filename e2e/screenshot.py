"""Screenshots of a real TensorBoard taken by headless Chromium: docs/observability.md's reward curve
(issue 28), taken by the tests from a job's event files.

    python3 -m e2e.screenshot LOGDIR OUT.png [--tag critic/rewards/mean] [--size 1280x720]

* `TensorBoardUI(logdir)` runs `tensorboard` on a free 127.0.0.1 port, ready once its
  HTTP API lists every run of the logdir and the tag; stopped with its process group.
* `screenshot(url, png)` drives Debian's `chromium-headless-shell` through the DevTools
  protocol over a pipe (`--remote-debugging-pipe`: the standard library is enough), and
  captures the page once a JavaScript condition holds. Chromium's own `--screenshot`
  fires when a virtual-time budget runs out, which here came before TensorBoard had
  drawn its data in 2 runs out of 5.
* `curve_drawn(png)` reads the PNG back: a line in TensorBoard's first run colour across
  a good part of the image, what no page without the curve shows.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from .host import free_port, log_tail, stop_group

REWARD_TAG = "critic/rewards/mean"
SIZE = (1280, 720)
CHROMIUM_PACKAGE = "chromium-headless-shell"  # Debian's; /usr/bin's is a sh wrapper around this binary
CHROMIUM_BINARY = "/usr/lib/chromium/chromium-headless-shell"
TENSORBOARD_START_TIMEOUT = 120.0
SCREENSHOT_TIMEOUT = 60.0
CAPTURE_SECONDS = 10.0  # kept from the timeout to capture what the page shows if it never gets ready

# The time-series dashboard as TensorBoard saves its settings (localStorage), set before the
# page loads: no settings pane over the chart, no "outliers" cut off the curve's ends, the
# light theme, whose palette FIRST_RUN_COLOUR is from.
TENSORBOARD_SETTINGS = {"timeSeriesSettingsPaneOpened": False, "ignoreOutliers": False, "theme": "light"}
FIRST_RUN_COLOUR = (0x42, 0x50, 0x66)  # "Slate", the light theme's first run colour
COLOUR_TOLERANCE = 12  # per channel: the line's antialiased core matches, greys (text, icons) do not
MAX_GAP = 3  # columns without the colour inside one line (a steep segment's antialiasing)
MIN_CURVE_WIDTH = 0.25  # of the image: a run's legend dots span a few pixels


class ScreenshotError(RuntimeError):
    """Chromium or TensorBoard could not be started, or the page never showed the curve."""


def find_chromium() -> str:
    """The chromium-headless-shell binary, or an error naming its Debian package."""
    for path in (CHROMIUM_BINARY, shutil.which(CHROMIUM_PACKAGE)):
        if path and os.access(path, os.X_OK):
            return path
    raise ScreenshotError(f"{CHROMIUM_PACKAGE} not found: install the Debian package "
                          f"(`apt-get install {CHROMIUM_PACKAGE}`, or `bash e2e/host-packages.sh` as root)")


# ------------------------------------------------------------------ TensorBoard


class TensorBoardUI:
    """A real TensorBoard serving `logdir`, ready once its API lists every run directory
    (those holding event files) and `tag` in one of them."""

    def __init__(self, logdir: Path, tag: str = REWARD_TAG, timeout: float = TENSORBOARD_START_TIMEOUT):
        self.logdir, self.tag, self.timeout = Path(logdir), tag, timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.started_in: float | None = None  # seconds from start to ready
        self._tmp = tempfile.TemporaryDirectory(prefix="rft-tensorboard-")
        self.log = Path(self._tmp.name) / "tensorboard.log"

    def start(self) -> "TensorBoardUI":
        runs = {str(p.parent.relative_to(self.logdir)) for p in self.logdir.rglob("events.out.tfevents.*")}
        if not runs:
            raise ScreenshotError(f"no TensorBoard event files under {self.logdir}")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tensorboard.main", "--logdir", str(self.logdir), "--host", "127.0.0.1",
                 "--port", str(self.port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        began = time.monotonic()
        try:
            self._wait_until_ready(runs, began + self.timeout)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - began
        return self

    def _wait_until_ready(self, runs: set[str], deadline: float) -> None:
        while not self._ready(runs):
            if self.proc.poll() is not None:
                raise ScreenshotError(f"tensorboard exited {self.proc.returncode}:\n{log_tail(self.log)}")
            if time.monotonic() > deadline:
                raise ScreenshotError(f"tensorboard did not list runs {sorted(runs)} and tag {self.tag!r} within "
                                      f"{self.timeout:.0f}s; it lists {self._get('/data/plugin/scalars/tags')}:\n"
                                      f"{log_tail(self.log)}")
            time.sleep(0.2)  # polling its API

    def _get(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def _ready(self, runs: set[str]) -> bool:
        listed = self._get("/data/runs") or []
        tags = self._get("/data/plugin/scalars/tags") or {}
        return runs <= set(listed) and any(self.tag in run_tags for run_tags in tags.values())

    def curve_url(self) -> str:
        """The time-series dashboard showing only `tag`'s card, unsmoothed. Runs coloured by
        experiment: all in FIRST_RUN_COLOUR, whichever run TensorBoard lists first (a job's
        explorer run may start before the trainer's). `forceSVG` is TensorBoard's flag to
        draw lines as SVG: its default WebGL has no GPU in headless Chromium (the line was
        not drawn), and an SVG line is in the DOM to wait for."""
        query = urllib.parse.urlencode({"tagFilter": f"^{re.escape(self.tag)}$", "smoothing": 0,
                                        "runColorGroup": "experiment", "forceSVG": "true"})
        return f"{self.url}/?{query}#timeseries"

    def screenshot(self, out_png: Path, size: tuple[int, int] = SIZE, timeout: float = SCREENSHOT_TIMEOUT) -> Path:
        """`tag`'s card enlarged to full size, captured once its line is drawn."""
        settings = f"localStorage.setItem('_tb_global_settings', {json.dumps(json.dumps(TENSORBOARD_SETTINGS))})"
        return screenshot(self.curve_url(), out_png, size, ready=curve_shown_js(self.tag), before_load=settings,
                          timeout=timeout)

    def stop(self) -> None:
        stop_group(self.proc, 20)

    def __enter__(self) -> "TensorBoardUI":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self._tmp.cleanup()


def curve_shown_js(tag: str) -> str:
    """True once `tag`'s card has drawn its line; on the first call that finds the line it
    presses the card's "Toggle full size mode", then waits for the line to be redrawn wide."""
    return f"""(() => {{
  const card = [...document.querySelectorAll("scalar-card-component")].find(c => c.textContent.includes({json.dumps(tag)}));
  const line = card && card.querySelector(".series-view path[style*='stroke']");
  if (!line || !(line.getAttribute("d") || "").includes("L")) return false;
  const full = card.querySelector("button[aria-label='Toggle full size mode']");
  if (full && !window.rftFullSize) {{ window.rftFullSize = true; full.click(); return false; }}
  return !full || line.getBoundingClientRect().width > innerWidth / 2;
}})()"""


def screenshot_tensorboard(logdir: Path, out_png: Path, tag: str = REWARD_TAG, size: tuple[int, int] = SIZE) -> Path:
    """Starts TensorBoard on `logdir`, captures `tag`'s curve to `out_png`, stops it."""
    with TensorBoardUI(logdir, tag) as board:
        return board.screenshot(out_png, size)


# ------------------------------------------------------------------ headless Chromium


class DevTools:
    """Headless Chromium driven through the DevTools protocol over a pipe: JSON messages
    ended by NUL, commands written to its fd 3, answers and events read from its fd 4.
    A fresh profile (TensorBoard keeps its settings in localStorage), removed on close."""

    def __init__(self, size: tuple[int, int], deadline: float):
        binary = find_chromium()
        self.deadline = deadline
        self._tmp = tempfile.TemporaryDirectory(prefix="rft-chromium-")
        self.log = Path(self._tmp.name) / "chromium.log"
        cmd_read, self._cmd = os.pipe()
        self._answers, answer_write = os.pipe()
        # Above 4, so that placing them on 3 and 4 in the child cannot overwrite one another.
        cmd_read, answer_write = _fd_above(cmd_read, 5), _fd_above(answer_write, 5)
        args = [binary, "--remote-debugging-pipe", f"--user-data-dir={self._tmp.name}/profile",
                f"--window-size={size[0]},{size[1]}", "--hide-scrollbars", "--no-first-run",
                "--disable-dev-shm-usage", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to start its sandbox as root
        with open(self.log, "wb") as log:
            # close_fds=False: with close_fds, fds 3 and 4 would be closed after preexec_fn
            # put the pipes there. Nothing else leaks: Python's own fds are not inheritable.
            # preexec_fn only calls dup2, which is safe in a forked child even with threads.
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                close_fds=False, preexec_fn=lambda: (os.dup2(cmd_read, 3), os.dup2(answer_write, 4)))
        os.close(cmd_read)
        os.close(answer_write)
        self._buffer = b""
        self._id = 0

    def call(self, method: str, session: str | None = None, **params: Any) -> dict:
        """Sends a command and returns its result, skipping the events that come between."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._cmd, data):]
        while True:
            answer = json.loads(self._read_message(method))
            if answer.get("id") == self._id:
                if "error" in answer:
                    raise ScreenshotError(f"Chromium refused {method}: {answer['error'].get('message')}")
                return answer.get("result", {})

    def _read_message(self, method: str) -> bytes:
        while b"\0" not in self._buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                raise ScreenshotError(f"Chromium did not answer {method} in time:\n{log_tail(self.log)}")
            chunk = os.read(self._answers, 1 << 20)
            if not chunk:
                raise ScreenshotError(f"Chromium exited ({self.proc.poll()}) during {method}:\n{log_tail(self.log)}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return message

    def close(self) -> None:
        try:
            os.write(self._cmd, json.dumps({"id": self._id + 1, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        finally:
            os.close(self._cmd)
            os.close(self._answers)
            self._tmp.cleanup()


def _fd_above(fd: int, lowest: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return moved


def screenshot(url: str, out_png: Path, size: tuple[int, int] = SIZE, ready: str = "document.readyState == 'complete'",
               before_load: str | None = None, timeout: float = SCREENSHOT_TIMEOUT) -> Path:
    """Opens `url` in headless Chromium at `size` (CSS pixels), waits until the JavaScript
    expression `ready` is true, and writes the page as PNG to `out_png`. `before_load` is
    run in the page before its own scripts. When `ready` stays false the page is captured
    all the same (to look at) and ScreenshotError names the file."""
    out_png = Path(out_png)
    began = time.monotonic()
    browser = DevTools(size, deadline=began + timeout)
    try:
        target = browser.call("Target.createTarget", url="about:blank")["targetId"]
        page = browser.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        browser.call("Emulation.setDeviceMetricsOverride", page, width=size[0], height=size[1],
                     deviceScaleFactor=1, mobile=False)
        browser.call("Page.enable", page)
        if before_load:
            browser.call("Page.addScriptToEvaluateOnNewDocument", page, source=before_load)
        error = browser.call("Page.navigate", page, url=url).get("errorText")
        if error:
            raise ScreenshotError(f"Chromium could not open {url}: {error}")
        shown, last = False, None
        while not shown and time.monotonic() < browser.deadline - CAPTURE_SECONDS:
            answer = browser.call("Runtime.evaluate", page, expression=ready, returnByValue=True)
            shown = answer.get("result", {}).get("value") is True
            last = answer.get("exceptionDetails", {}).get("exception", {}).get("description", last)
            if not shown:
                time.sleep(0.1)  # polling the page
        out_png.parent.mkdir(parents=True, exist_ok=True)
        out_png.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", page, format="png")["data"]))
    finally:
        browser.close()
    if not shown:
        raise ScreenshotError(f"{url} did not get ready within {timeout - CAPTURE_SECONDS:.0f}s "
                              f"(last error: {last}); what it showed: {out_png}")
    return out_png


# ------------------------------------------------------------------ reading the PNG back


def find_curve(png: Path, colour: tuple[int, int, int] = FIRST_RUN_COLOUR) -> list[tuple[int, float]]:
    """The widest line of `colour` in the image: (x, y) per pixel column, y the middle of
    the colour's pixels in that column (0 is the top); [] when the colour is not there."""
    from PIL import Image, ImageChops

    with Image.open(png) as image:
        rgb = image.convert("RGB")
    width = rgb.width
    red, green, blue = ImageChops.difference(rgb, Image.new("RGB", rgb.size, colour)).split()
    distance = ImageChops.lighter(ImageChops.lighter(red, green), blue)
    mask = distance.point(lambda d: 255 if d <= COLOUR_TOLERANCE else 0).tobytes()
    columns = {}
    for x in range(width):
        column = mask[x::width]
        top = column.find(255)
        if top >= 0:
            columns[x] = (top + column.rfind(255)) / 2
    xs = sorted(columns)
    stretches, start = [], 0
    for i in range(1, len(xs) + 1):
        if i == len(xs) or xs[i] - xs[i - 1] > MAX_GAP + 1:
            stretches.append(xs[start:i])
            start = i
    widest = max(stretches, key=lambda s: s[-1] - s[0], default=[])
    return [(x, columns[x]) for x in widest]


def curve_drawn(png: Path, min_width: float = MIN_CURVE_WIDTH) -> bool:
    """Whether the screenshot shows a line of the first run's colour across at least
    `min_width` of its width: the curve, not the run's legend dots."""
    from PIL import Image

    curve = find_curve(png)
    with Image.open(png) as image:
        width = image.width
    return bool(curve) and curve[-1][0] - curve[0][0] + 1 >= min_width * width


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m e2e.screenshot", description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir", type=Path, help="TensorBoard's logdir (e.g. a job's copied event files)")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--tag", default=REWARD_TAG)
    parser.add_argument("--size", default=f"{SIZE[0]}x{SIZE[1]}", help="WIDTHxHEIGHT in CSS pixels")
    args = parser.parse_args(argv)
    size = tuple(int(n) for n in args.size.lower().split("x"))
    with TensorBoardUI(args.logdir, args.tag) as board:
        began = time.monotonic()
        png = board.screenshot(args.out, size)
        took = time.monotonic() - began
    drawn = curve_drawn(png)
    print(f"TensorBoard ready in {board.started_in:.1f}s, screenshot in {took:.1f}s: {png} "
          f"({png.stat().st_size // 1024} KB, curve drawn: {drawn})")
    return 0 if drawn else 1


if __name__ == "__main__":
    sys.exit(main())
