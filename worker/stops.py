"""Stop sequences matched on decoded text, across token boundaries.

Text arrives a piece at a time (whatever complete characters each new token adds). The matcher
releases text only once it can no longer become part of a stop sequence, so a streamed delta
never shows a prefix of a stop sequence that is later cut.
"""
from __future__ import annotations


class StopMatcher:
    """`push(text)` -> the text now safe to release; `stopped` turns True when a stop sequence
    completes (text from its start on is dropped, or, with `include_stop`, from its end on) and
    `matched` names it. `flush()` releases what is held when the sequence ends for another reason."""

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.held = ""  # tail that could still be the start of a stop sequence
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        # everything before self.held was released, so a stop can only start inside buf
        # the stop that completes first wins (as if the text had come one character at a time);
        # of two ending together, the longer
        hits = [(i + len(s), i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            end, start, self.matched = min(hits)
            self.stopped, self.held = True, ""
            return buf[:end] if self.include_stop else buf[:start]
        keep = self._partial_stop_len(buf)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop sequence."""
        longest = max(len(s) for s in self.stops) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
