"""Progress of a long loop: a bar with ETA on a terminal, plain lines in a log.

    progress = Progress(total=400, label="moda-pre")
    for step in range(400):
        ...
        progress.update(step + 1, loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")
    progress.close()

On a terminal one line is redrawn in place (``\\r``), at most ten times a
second::

    moda-pre [#########...........] 180/400  45% | loss 1.7311 | tok_s 13,120 | 0:29 left

Written to a file or a pipe, a ``\\r`` line would become one endless line, so
the same fields go out as plain lines, ``lines`` of them over the loop::

    moda-pre  180/400  45% | loss 1.7311 | tok_s 13,120 | 0:29 left

The time left is the pace since the first update (which usually includes
compilation and warm-up, and so is left out) times the steps still to run.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def format_duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"`` or ``"1h02m"``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Reports ``update(done)`` calls for a loop of ``total`` steps.

    Args:
        total: the steps of the loop, >= 1.
        label: printed at the start of every line.
        stream: where to write (default: ``sys.stdout``); a bar if it is a
            terminal, plain lines otherwise.
        lines: plain lines over the whole loop (not on a terminal); the last
            step always gets one.
        bar_width: characters of the bar.

    Attributes:
        seconds_left: the estimated seconds to the end, None before the second update.
    """

    def __init__(
        self, total: int, label: str = "", stream: Optional[TextIO] = None, lines: int = 10, bar_width: int = 24
    ):
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be an int >= 1, got {total!r}")
        if lines < 1:
            raise ValueError(f"lines must be >= 1, got {lines!r}")
        self.total, self.label, self.bar_width = total, label, bar_width
        self.stream = stream if stream is not None else sys.stdout
        self.terminal = self.stream.isatty()
        self.every = max(1, total // lines)
        self._first: Optional[tuple[int, float]] = None  # (steps done, time) at the first update
        self._drawn_at = 0.0
        self._open = False  # a bar line without its newline yet
        self.seconds_left: Optional[float] = None

    def update(self, done: int, **fields) -> None:
        """``done`` steps of ``total`` are finished; ``fields`` are shown as ``name value``."""
        now = time.perf_counter()
        if self._first is None:
            self._first = (done, now)
        elif done > self._first[0]:
            pace = (now - self._first[1]) / (done - self._first[0])
            self.seconds_left = pace * (self.total - done)
        last = done >= self.total
        if self.terminal:
            if last or now - self._drawn_at >= 0.1:
                self._drawn_at = now
                self.stream.write("\r" + self._line(done, fields, bar=True))
                self._open = True
                if last:
                    self.close()
        elif last or done % self.every == 0:
            self.stream.write(self._line(done, fields, bar=False) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line (on a terminal); call once the loop is over, however it ended."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

    def _line(self, done: int, fields: dict, bar: bool) -> str:
        parts = [f"{done}/{self.total} {100 * done / self.total:3.0f}%"]
        parts += [f"{name} {value}" for name, value in fields.items()]
        if self.seconds_left is not None and done < self.total:
            parts.append(f"{format_duration(self.seconds_left)} left")
        head = self.label
        if bar:
            filled = self.bar_width * done // self.total
            head += f" [{'#' * filled}{'.' * (self.bar_width - filled)}]"
        return f"{head} " + " | ".join(parts)
