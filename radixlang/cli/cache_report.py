"""What an engine's prompt cache did, in a few lines for a terminal: from ``Engine.stats()`` (or a
server's ``/get_server_info`` ``stats``), whole or as the change between two readings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Stats that only grow: the difference of two readings is the work done between them.
COUNTERS = (
    "prompt_tokens",
    "prompt_tokens_reused",
    "prompt_tokens_computed",
    "generated_tokens",
    "finished_requests",
    "steps",
)


def format_stats(s: Mapping[str, Any]) -> str:
    """Requests and tokens, prompt tokens reused vs computed (the hit rate), KV blocks."""
    return "\n".join(
        [
            f"requests      {s['finished_requests']} finished; "
            f"generated {s['generated_tokens']} tokens in {s['steps']} steps "
            f"({s['busy_tokens_per_second']:.1f} tok/s while busy)",
            format_prompt_tokens(s),
            format_blocks(s),
        ]
    )


def format_prompt_tokens(s: Mapping[str, Any]) -> str:
    total = s["prompt_tokens"]
    rate = s["prompt_tokens_reused"] / total if total else 0.0
    return (
        f"prompt tokens {total}: {s['prompt_tokens_reused']} reused from the cache, "
        f"{s['prompt_tokens_computed']} computed (hit rate {rate:.1%})"
    )


def format_blocks(s: Mapping[str, Any]) -> str:
    return (
        f"KV blocks     {s['blocks_used']} used ({s['blocks_evictable']} cached, evictable), "
        f"{s['blocks_free']} free of {s['blocks_total']}; {s['cached_tokens']} tokens cached"
    )


def stats_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """``after`` with its counters less ``before``'s: the work between the two readings, and
    the state (blocks, cached tokens) at the second."""
    return {**after, **{k: after[k] - before.get(k, 0) for k in COUNTERS if k in after}}
