"""Stop strings, cut exactly: the text up to (not including) the first stop string to
complete is emitted, nothing after it. Text that might be the start of a stop string
is held back until it is decided, so a stop split across tokens is still found."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add generated text; return what can be emitted now."""
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        # The model stops at the first stop string it *completes*; of several ending at the
        # same character the longest wins. Earliest end, not earliest start, so the cut
        # does not depend on how the text was split into tokens.
        first, which, best = -1, None, None
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (best is None or (i + len(s), i) < best):
                first, which, best = i, s, (i + len(s), i)
        if first != -1:
            self.stopped, self.matched, self._held = True, which, ""
            return buf[:first]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """End of generation: held-back text was not a stop after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
