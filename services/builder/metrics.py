"""The builder's Prometheus metrics (on top of the shared consumer metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

BUILDS = Counter(
    "polar_builder_builds_total",
    "Sessions handled, by builder and result (built | fallback | skipped | retried)",
    ["builder", "result"],
)
TOKENS = Counter(
    "polar_builder_tokens_total",
    "Tokens: trainer (what a trainer processes), sampled, per_request (unmerged equivalent)",
    ["kind"],
)
MERGE_RATIO = Histogram(
    "polar_builder_merge_ratio",
    "Per-request tokens / built tokens, per session",
    buckets=(1, 1.5, 2, 3, 5, 8, 13, 21, 34, 55),
)
BREAKS = Counter("polar_builder_breaks_total", "Chains started, by break reason", ["reason"])
BUILD_SECONDS = Histogram(
    "polar_builder_build_seconds",
    "Time to build one session (read, build, store, announce)",
    buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
)


def observe(trajectory, seconds: float) -> None:
    stats = trajectory.stats
    result = "fallback" if "build_error" in trajectory.metadata else "built"
    BUILDS.labels(trajectory.builder, result).inc()
    TOKENS.labels("trainer").inc(stats.tokens)
    TOKENS.labels("sampled").inc(stats.sampled_tokens)
    TOKENS.labels("per_request").inc(round(stats.tokens * stats.merge_ratio))
    if stats.tokens:
        MERGE_RATIO.observe(stats.merge_ratio)
    for reason, n in stats.breaks.items():
        BREAKS.labels(reason).inc(n)
    BUILD_SECONDS.observe(seconds)
