"""``GET /metrics`` in Prometheus' text format: the engine's figures read at scrape time, and the
server's own HTTP counters.

Written out directly rather than through ``prometheus_client``: every engine figure is read fresh
from ``Engine.stats()`` at each scrape (no registry to keep in step), and that library's
process-wide default registry would mix the figures of several engines in one process.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PREFIX = "radixlang_"

# (stats key, metric name, type, help)
_ENGINE_METRICS = [
    ("running_requests", "requests_running", "gauge", "Requests in the running batch."),
    ("waiting_requests", "requests_waiting", "gauge", "Requests queued for admission."),
    ("finished_requests", "requests_finished_total", "counter", "Requests finished."),
    ("generated_tokens", "generated_tokens_total", "counter", "Tokens generated."),
    ("prompt_tokens", "prompt_tokens_total", "counter", "Prompt tokens admitted."),
    ("prompt_tokens_reused", "prompt_tokens_cached_total", "counter",
     "Prompt tokens reused from the radix cache."),
    ("prompt_tokens_computed", "prompt_tokens_computed_total", "counter",
     "Prompt tokens computed."),
    ("cache_hit_rate", "cache_hit_rate", "gauge", "Prompt tokens reused / prompt tokens."),
    ("cached_tokens", "cached_tokens", "gauge", "Tokens held in the radix cache."),
    ("blocks_total", "kv_blocks_total", "gauge", "KV blocks in the pool."),
    ("blocks_free", "kv_blocks_free", "gauge", "KV blocks free."),
    ("blocks_used", "kv_blocks_used", "gauge", "KV blocks in use (cached or held)."),
    ("blocks_evictable", "kv_blocks_evictable", "gauge",
     "KV blocks held only by the cache, evictable."),
    ("retractions", "retractions_total", "counter", "Requests retracted under memory pressure."),
    ("evicted_blocks", "evicted_blocks_total", "counter", "KV blocks evicted from the cache."),
    ("steps", "engine_steps_total", "counter", "Engine steps run."),
    ("tokens_per_second", "generation_tokens_per_second", "gauge",
     "Tokens generated per second over the last seconds."),
]  # fmt: skip
# Speculative decoding's, where the engine drafts (speculative="ngram").
_SPEC_METRICS = [
    ("spec_verify_steps", "spec_verify_steps_total", "counter", "Steps that verified drafts."),
    ("spec_draft_tokens", "spec_draft_tokens_total", "counter", "Draft tokens verified."),
    ("spec_accepted_tokens", "spec_accepted_tokens_total", "counter",
     "Draft tokens accepted."),
]  # fmt: skip
# The tiers', where the engine has a host tier (and a disk tier under it).
_TIER_METRICS = [
    ("tier_written_blocks_total", "tier_written_blocks_total", "counter",
     "KV blocks demoted from the pool to the host tier."),
    ("tier_loaded_blocks_total", "tier_loaded_blocks_total", "counter",
     "KV blocks loaded back from the tier."),
    ("tier_loaded_ahead_blocks_total", "tier_loaded_ahead_blocks_total", "counter",
     "Of those: resident before the request that needed them was admitted (prefetched)."),
    ("tier_loaded_late_blocks_total", "tier_loaded_late_blocks_total", "counter",
     "Of those: prefetched, but admission waited for the copy."),
    ("tier_prefetch_unused_blocks_total", "tier_prefetch_unused_blocks_total", "counter",
     "Prefetched blocks evicted again before any use."),
    ("tier_dropped_tokens_total", "tier_dropped_tokens_total", "counter",
     "Tiered tokens dropped for good (the tier was full)."),
    ("disk_spilled_blocks_total", "disk_spilled_blocks_total", "counter",
     "Tier blocks spilled from host memory to the disk tier."),
    ("disk_read_blocks_total", "disk_read_blocks_total", "counter",
     "Tier blocks read back from the disk tier."),
]  # fmt: skip
_REASONS = ("stop", "length", "abort", "error")
_ROUTES = ("retained", "key", "prefix", "load", "round_robin")  # cluster/router.py REASONS


@dataclass
class HTTPCounters:
    """The server's own counts (touched only on the event loop)."""

    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    in_flight: int = 0


def _line(name: str, value: float, labels: str = "") -> str:
    return f"{PREFIX}{name}{labels} {value}"


def _head(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]


def engine_samples(stats: dict[str, float | int]) -> dict[str, float | int]:
    """The engine's samples of the page by full name (labels included), as :func:`render`
    writes them: what the dashboard shows, so that its figures and /metrics agree."""
    samples = {PREFIX + name: stats[key] for key, name, _, _ in _ENGINE_METRICS}
    samples[PREFIX + "kv_blocks_held"] = blocks_held(stats)
    for reason in _REASONS:
        label = f'{PREFIX}requests_finished_by_reason_total{{reason="{reason}"}}'
        samples[label] = stats.get(f"finished_{reason}", 0)
    return samples


def blocks_held(stats: dict[str, float | int]) -> int:
    """Blocks that neither the free list nor the cache alone holds: running requests' (or a
    leak, when the engine is idle)."""
    return int(stats["blocks_used"]) - int(stats["blocks_evictable"])


def render(stats: dict[str, float | int], http: HTTPCounters) -> str:
    out: list[str] = []
    for key, name, kind, help_text in _ENGINE_METRICS:
        out += _head(name, kind, help_text)
        out.append(_line(name, stats[key]))
    out += _head("kv_blocks_held", "gauge", "KV blocks held by requests (used - evictable).")
    out.append(_line("kv_blocks_held", blocks_held(stats)))
    out += _head("requests_finished_by_reason_total", "counter", "Requests finished, by reason.")
    for reason in _REASONS:
        count = stats.get(f"finished_{reason}", 0)
        out.append(_line("requests_finished_by_reason_total", count, f'{{reason="{reason}"}}'))
    for key, name, kind, help_text in _SPEC_METRICS + _TIER_METRICS:
        if key in stats:
            out += _head(name, kind, help_text)
            out.append(_line(name, stats[key]))
    if "replicas" in stats:  # several engines behind a router (radixlang/cluster/)
        out += _head("replicas_up", "gauge", "Replicas in rotation.")
        out.append(_line("replicas_up", stats["replicas_up"]))
        out += _head("routed_requests_total", "counter", "Requests routed, by the rule that chose.")
        for reason in _ROUTES:
            count = stats.get(f"routed_{reason}", 0)
            out.append(_line("routed_requests_total", count, f'{{reason="{reason}"}}'))
        out += _head(
            "replica_failed_requests_total",
            "counter",
            "Requests failed because their replica died (retried ones not counted).",
        )
        out.append(_line("replica_failed_requests_total", stats["failed_requests"]))
        out += _head(
            "replica_retried_requests_total",
            "counter",
            "Requests sent again after their replica died before they streamed.",
        )
        out.append(_line("replica_retried_requests_total", stats["retried_requests"]))
    out += _head("http_requests_total", "counter", "HTTP requests answered, by route and status.")
    for (route, code), count in sorted(http.requests.items()):
        out.append(_line("http_requests_total", count, f'{{route="{route}",code="{code}"}}'))
    out += _head("http_requests_in_flight", "gauge", "HTTP requests being answered.")
    out.append(_line("http_requests_in_flight", http.in_flight))
    return "\n".join(out) + "\n"


def parse(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page by their full name (with labels): for tests and
    clients that want one figure."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
