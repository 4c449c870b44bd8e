"""The console a person watches: one progress bar per stage (SFT, RL, evaluation) on a terminal,
and short lines above it; nothing but the lines when the output is not a terminal (a log file, CI,
a notebook cell), so logs stay one line per record.

`metrics.jsonl` has every field of every record; the console shows a few numbers.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Mapping, TextIO


class Console:
    """`line(text)` prints above the live bar; `bar(...)` opens one (closing the previous)."""

    def __init__(self, enabled: bool = True, *, stream: TextIO | None = None, progress: bool | None = None):
        self.enabled = enabled
        self.stream = stream
        # None: a bar only when the stream is a terminal (tqdm's own rule).
        self.progress = progress
        self._bar = None
        self._description = ""

    @property
    def live(self) -> bool:
        """Whether a bar is open (shown or not)."""
        return self._bar is not None

    def _stream(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stdout

    def bar(self, description: str, total: int | None, initial: int = 0, *, unit: str = "it",
            leave: bool = True):
        """A progress bar (tqdm) that `advance` moves; a no-op object when disabled."""
        self.close()
        if not self.enabled:
            return None
        from tqdm import tqdm

        disable = None if self.progress is None else not self.progress
        self._description = description
        self._bar = tqdm(total=total, initial=initial, desc=description, unit=unit, leave=leave,
                         file=self._stream(), disable=disable, dynamic_ncols=True, mininterval=0.5,
                         bar_format="{desc} {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} "
                                    "[{elapsed}<{remaining}]{postfix}")
        return self._bar

    def advance(self, n: int = 1, postfix: Mapping[str, Any] | str | None = None) -> None:
        if self._bar is None:
            return
        if postfix is not None:
            text = postfix if isinstance(postfix, str) else " ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items())
            self._bar.set_postfix_str(text, refresh=False)
        self._bar.update(n)

    def detail(self, text: str | None) -> None:
        """Appends `text` to the live bar's label (e.g. 'eval 2/3' while the RL stage evaluates);
        None restores the label."""
        if self._bar is not None:
            self._bar.set_description_str(self._description + (f" ({text})" if text else ""))

    @contextlib.contextmanager
    def sub_progress(self, name: str, total: int, *, unit: str = "it") -> Iterator[Callable[[int], None]]:
        """`progress(done)` for a sub-task (an evaluation): its own transient bar when no bar is
        open, else `name done/total` beside the open stage's label (restored at the end)."""
        transient = not self.live
        if transient:
            self.bar(name, total, unit=unit, leave=False)

        def progress(done: int) -> None:
            if transient:
                self.advance(1)
            else:
                self.detail(f"{name} {done}/{total}")

        try:
            yield progress
        finally:
            if transient:
                self.close()
            else:
                self.detail(None)

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None and not self._bar.disable:
            self._bar.write(text, file=self._stream())
        else:
            print(text, file=self._stream(), flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
