"""TextGuard: the last filter before streamed text reaches a client.

It cuts the text at the first stop string (OpenAI semantics: the stop string is not returned),
drops marker strings such as `<|END_TEXT|>` that the model spelled out with ordinary tokens, and
holds back a tail that may still become either, so nothing is sent that must later be taken back.
It sees only text; channel switching on token ids is output_parser.py's job.
"""

from __future__ import annotations


class TextGuard:
    def __init__(self, stop: list[str], drop: list[str]) -> None:
        self._stop = [s for s in stop if s]
        self._drop = [d for d in drop if d]
        self._pending = ""  # text held back: it may begin a stop or drop string
        self.stopped = False  # a stop string was seen; everything after it is discarded

    def push(self, text: str) -> str:
        """Return the part of `pending + text` that is safe to send now."""
        if self.stopped:
            return ""
        buf = self._pending + text
        out = []
        while True:
            hit = self._earliest(buf)
            if hit is None:
                break
            idx, pattern, is_stop = hit
            out.append(buf[:idx])
            if is_stop:
                self.stopped, self._pending = True, ""
                return "".join(out)
            buf = buf[idx + len(pattern) :]
        keep = self._held_tail_len(buf)
        out.append(buf[: len(buf) - keep])
        self._pending = buf[len(buf) - keep :]
        return "".join(out)

    def flush(self) -> str:
        """At the end of the stream: the held tail was not a stop or marker string after all."""
        tail, self._pending = ("" if self.stopped else self._pending), ""
        return tail

    def _earliest(self, buf: str) -> tuple[int, str, bool] | None:
        best = None
        for patterns, is_stop in ((self._stop, True), (self._drop, False)):
            for pattern in patterns:
                idx = buf.find(pattern)
                if idx >= 0 and (best is None or idx < best[0]):
                    best = (idx, pattern, is_stop)
        return best

    def _held_tail_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some pattern."""
        longest = 0
        for pattern in self._stop + self._drop:
            for size in range(min(len(pattern) - 1, len(buf)), longest, -1):
                if buf.endswith(pattern[:size]):
                    longest = size
                    break
        return longest
