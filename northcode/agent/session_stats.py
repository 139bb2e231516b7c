"""What the app's status line reports about a session, and its one-line text.

SessionStats holds the fields (model, mode, live tokens/s, TTFT, context used of the window,
prefix-cache share, KV use; None where not known yet). StreamRate derives TTFT and the live
rate from the streamed fragments, usage_changes() the rest from each completion's usage; the
KV use comes from agent/metrics.py. No UI here: tui/widgets.py's StatusLine shows `line()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from northcode.agent.client import Completion, Delta


COMPACT_HINT_SHARE = 0.8  # of the context window used: the status line suggests /compact from here
DROP_ORDER = ("workspace", "kv", "ttft", "cache", "rate", "mode")  # what a narrow status line leaves out first


@dataclass
class SessionStats:
    """What the status line shows; None where not known yet."""

    model: str = "connecting…"
    mode: str = "ask"
    workspace: str = ""
    tokens_per_s: float | None = None
    ttft_s: float | None = None
    context_used: int | None = None  # tokens: prompt + completion of the last request
    context_window: int | None = None
    cache_share: float | None = None  # cached_tokens / prompt_tokens of the last request
    kv_usage: float | None = None  # fraction of the server's KV pages in use
    busy: str = ""  # "generating…", "loading: …", "" when idle

    def line(self, width: int | None = None) -> str:
        """The status line; the context part suggests /compact once the window is COMPACT_HINT_SHARE full. Where
        it is wider than `width`, its parts go in DROP_ORDER (the workspace first) until it fits."""
        parts = {"model": self.model, "mode": f"mode {self.mode}",
                 "rate": f"{self.tokens_per_s:.1f} tok/s" if self.tokens_per_s is not None else "– tok/s",
                 "ttft": f"TTFT {self.ttft_s * 1000:.0f} ms" if self.ttft_s is not None else "TTFT –"}
        if self.context_used is not None and self.context_window:
            share = self.context_used / self.context_window
            hint = " /compact" if share >= COMPACT_HINT_SHARE else ""
            parts["ctx"] = f"ctx {self.context_used}/{self.context_window} ({share:.0%}){hint}"
        elif self.context_used is not None:
            parts["ctx"] = f"ctx {self.context_used}"
        parts["cache"] = f"cache {self.cache_share:.0%}" if self.cache_share is not None else "cache –"
        parts["kv"] = f"KV {percent(self.kv_usage)}" if self.kv_usage is not None else "KV –"
        if self.workspace:
            parts["workspace"] = self.workspace
        text = self._join(parts)
        for name in DROP_ORDER:
            if width is None or len(text) <= width:
                break
            parts.pop(name, None)
            text = self._join(parts)
        return text

    def _join(self, parts: dict[str, str]) -> str:
        text = " │ ".join(parts.values())
        return f"{self.busy}  {text}" if self.busy else text


def percent(fraction: float) -> str:
    """0.25 -> "25%", but 0.003 -> "0.3%": a big KV pool in use by one chat is not "0%"."""
    if 0 < fraction < 0.001:
        return "<0.1%"
    return f"{fraction:.1%}" if 0 < fraction < 0.095 else f"{fraction:.0%}"


def usage_changes(completion: Completion) -> dict:
    """The SessionStats fields one finished request sets: its TTFT, decode rate, context used, cache share."""
    usage = completion.usage or {}
    prompt_tokens = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    changes: dict = {"ttft_s": completion.ttft_s}
    if completion.decode_tokens_per_s is not None:
        changes["tokens_per_s"] = completion.decode_tokens_per_s
    if prompt_tokens:
        changes["context_used"] = prompt_tokens + (usage.get("completion_tokens") or 0)
        changes["cache_share"] = (cached or 0) / prompt_tokens
    return changes


class StreamRate:
    """TTFT and the live rate of one streamed answer: fragments (about one token each) per second since the first."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None  # (elapsed_s, num_chunks) at the first fragment

    def reset(self) -> None:
        """The stream ended: the next fragment starts a new one."""
        self.first = None

    def changes(self, delta: Delta) -> dict:
        """The SessionStats fields this fragment sets: TTFT at the first, then the live rate (not at a call's start)."""
        if self.first is None:
            self.first = (delta.elapsed_s, delta.num_chunks)
            return {"ttft_s": delta.elapsed_s}
        first_s, first_chunks = self.first
        if delta.kind == "tool_call" or delta.elapsed_s <= first_s:
            return {}
        return {"tokens_per_s": (delta.num_chunks - first_chunks) / (delta.elapsed_s - first_s)}
