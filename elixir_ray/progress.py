"""A terminal progress bar for training: step, loss, tokens/s and ETA on one line.

On a terminal it redraws in place; in a log (ray job logs, CI) it prints a line every
`every` steps instead, so logs stay readable.
"""

from __future__ import annotations

import sys
import time


def _fmt_seconds(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _fmt_rate(r: float) -> str:
    return f"{r / 1e6:.2f}M" if r >= 1e6 else f"{r / 1e3:.1f}k" if r >= 1e3 else f"{r:.0f}"


class ProgressBar:
    def __init__(self, total: int, every: int = 10, stream=None, width: int = 24):
        self.total, self.every, self.width = total, max(1, every), width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = None  # set at the first step, so start-up time does not skew the ETA
        self._first_step = 0
        self._last_len = 0

    def line(self, step: int, loss: float, tokens_per_s: float) -> str:
        if self.start is None:
            self.start, self._first_step = time.monotonic(), step
        done = step - self._first_step
        eta = (time.monotonic() - self.start) / done * (self.total - step) if done else 0.0
        filled = int(self.width * step / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        return (f"[{bar}] step {step}/{self.total}  loss {loss:.4f}  "
                f"{_fmt_rate(tokens_per_s)} tok/s  ETA {_fmt_seconds(eta)}")

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        first = self.start is None  # the first step shown (a resumed run's starts past 1)
        text = self.line(step, loss, tokens_per_s)
        if self.tty:
            self.stream.write("\r" + text.ljust(self._last_len))
            self._last_len = len(text)
        elif step % self.every == 0 or step == self.total or first:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line about something other than a step (a long checkpoint write), kept above the bar."""
        if self.tty and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
        self.stream.write(text + "\n")
        if self.tty and self._last_len:
            self._last_len = 0
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
