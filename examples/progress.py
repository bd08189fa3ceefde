"""Progress of a long loop: a bar with ETA on a terminal, plain lines in a log.

    progress = Progress(total=400, label="moda-pre")
    for step in range(400):
        ...
        progress.update(step + 1, f"loss {loss:.4f}", f"{tok_s:,.0f} tok/s")
    progress.close()

On a terminal one line is redrawn in place (``\\r``), at most ten times a
second::

    moda-pre [#########...........] 180/400  45% | loss 1.7311 | 13,120 tok/s | 29s left

Written to a file or a pipe, a ``\\r`` line would become one endless line, so
the same fields go out as plain lines, one every ``every`` steps and one at
the end::

    moda-pre 180/400  45% | loss 1.7311 | 13,120 tok/s | 29s left

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
        every: steps between plain lines (not on a terminal); default: a
            tenth of ``total``. The last step always gets one.
        bar_width: characters of the bar.

    Attributes:
        seconds_left: the estimated seconds to the end, None before the second update.
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        stream: Optional[TextIO] = None,
        every: Optional[int] = None,
        bar_width: int = 24,
    ):
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be an int >= 1, got {total!r}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be an int >= 1 or None, got {every!r}")
        self.total, self.label, self.bar_width = total, label, bar_width
        self.stream = stream if stream is not None else sys.stdout
        self.terminal = self.stream.isatty()
        self.every = every if every is not None else max(1, total // 10)
        self._first: Optional[tuple[int, float]] = None  # (steps done, time) at the first update
        self._drawn_at = 0.0
        self._open = False  # a bar line without its newline yet
        self._drawn_width = 0
        self.seconds_left: Optional[float] = None

    def update(self, done: int, *fields: str) -> None:
        """``done`` steps of ``total`` are finished; ``fields`` are shown after the count, in order."""
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
                line = self._line(done, fields, bar=True)
                # Spaces over what a longer previous line left behind.
                self.stream.write("\r" + line + " " * max(0, self._drawn_width - len(line)))
                self._drawn_width = len(line)
                self._open = True
                if last:
                    self.close()
        elif last or done % self.every == 0:
            self.stream.write(self._line(done, fields, bar=False) + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (an estimate, a warning) that a bar does not overwrite."""
        self.close()
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line (on a terminal); call once the loop is over, however it ended."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
            self._drawn_width = 0

    def _line(self, done: int, fields: tuple, bar: bool) -> str:
        parts = [f"{done}/{self.total} {100 * done / self.total:3.0f}%", *fields]
        if self.seconds_left is not None and done < self.total:
            parts.append(f"{format_duration(self.seconds_left)} left")
        head = self.label
        if bar:
            filled = self.bar_width * done // self.total
            head += f" [{'#' * filled}{'.' * (self.bar_width - filled)}]"
        return f"{head} " + " | ".join(parts)
