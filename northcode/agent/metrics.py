"""Reads the KV-cache use out of a server's Prometheus /metrics text, for the status line.

Servers name the gauge differently (northcode: pages in use and pages in total; vLLM:
`vllm:kv_cache_usage_perc`, a fraction), so this looks for either shape by name and returns
the fraction in use, or None when the server publishes neither.
"""

from __future__ import annotations


def parse_samples(text: str) -> dict[str, float]:
    """Metric name (labels dropped, summed over them) -> value, for every sample line."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            samples[name] = samples.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return samples


def kv_usage(text: str) -> float | None:
    """The fraction (0..1) of KV-cache pages in use, or None when /metrics does not say."""
    samples = {name.lower(): value for name, value in parse_samples(text).items()}
    kv = {name: value for name, value in samples.items() if "kv" in name}
    for name, value in kv.items():
        if any(word in name for word in ("usage", "utilization", "perc", "fraction")) and 0 <= value <= 1:
            return value
    used = [v for n, v in kv.items() if ("used" in n or "in_use" in n) and "total" not in n]
    total = [v for n, v in kv.items() if "total" in n and not n.endswith("_created")]
    if used and total and total[0] > 0:
        return used[0] / total[0]
    return None
