"""Builder benchmark: trainer tokens per session, prefix_merging vs per_request, and
builder throughput. Plain script (CPU only, no servers):

    python tests/bench/bench_builder.py [--sessions 3]

Sessions are synthetic token-mode agent loops (tests/unit/builder/synth.py) with sizes of a
coding agent: a 2,000-token system prompt with tools, 150-400 sampled tokens per turn,
200-1,500 tokens of tool output per turn; records are delta-encoded as the proxy stores
them. The real 30-turn fixture (tests/fixtures/completions) is reported as well.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from schemas import BuilderSpec, Outcome, SessionFinished, encode  # noqa: E402
from services.builder.logic import build_trajectory  # noqa: E402
from services.builder.strategies import default_registry  # noqa: E402
from services.builder.strategies.per_request import PerRequest  # noqa: E402
from services.builder.strategies.prefix_merging import PrefixMerging  # noqa: E402
from tests.unit.builder.synth import Capture, agent_loop, text  # noqa: E402


def session(turns: int, seed: int) -> list:
    rng = random.Random(seed)
    cap = Capture(f"bench-{turns}-{seed}")
    agent_loop(
        cap,
        rng,
        turns,
        system=text(rng, 2000),
        user=text(rng, 200),
        out_len=(150, 400),
        tool_len=(200, 1500),
    )
    return cap.records


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def bench_size(turns: int, n: int) -> dict:
    merged_tokens, pr_tokens, sampled, t_merge, t_pr, t_full = [], [], [], 0.0, 0.0, 0.0
    registry = default_registry()
    for seed in range(n):
        records = session(turns, seed)
        (traces, stats, _), dt = timed(PrefixMerging().build, records, {}, Outcome.COMPLETED)
        assert len(traces) == 1
        t_merge += dt
        (_, pr_stats), dt = timed(PerRequest().build, records, {}, Outcome.COMPLETED)
        t_pr += dt
        event = SessionFinished(session_id="b", task_id="b", outcome=Outcome.COMPLETED)
        start = time.perf_counter()
        encode(build_trajectory(event, BuilderSpec(), records, registry))
        t_full += time.perf_counter() - start
        merged_tokens.append(stats.tokens)
        pr_tokens.append(pr_stats.tokens)
        sampled.append(stats.sampled_tokens)
    return {
        "turns": turns,
        "merged": statistics.mean(merged_tokens),
        "per_request": statistics.mean(pr_tokens),
        "ratio": sum(pr_tokens) / sum(merged_tokens),
        "sampled": statistics.mean(sampled),
        # throughput: the unmerged tokens the builder reads and assembles, per second
        "merge_tok_s": sum(pr_tokens) / t_merge,
        "pr_tok_s": sum(pr_tokens) / t_pr,
        "service_tok_s": sum(pr_tokens) / t_full,
        "service_out_tok_s": sum(merged_tokens) / t_full,  # trainer tokens produced
        "ms_per_session": 1000 * t_full / n,
    }


def fixture_line() -> str:
    import msgspec

    from schemas import CompletionRecord

    path = Path(__file__).resolve().parents[1] / "fixtures" / "completions" / "token_30turn.jsonl"
    records = [
        msgspec.json.decode(x, type=CompletionRecord) for x in path.read_bytes().splitlines()
    ]
    _, stats, _ = PrefixMerging().build(records, {}, Outcome.COMPLETED)
    per_request = round(stats.tokens * stats.merge_ratio)
    return (
        f"real 30-turn fixture (tiny model): merged {stats.tokens} tokens, per_request "
        f"{per_request}, ratio {stats.merge_ratio:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=3, help="sessions per size")
    args = ap.parse_args()
    print(
        f"{'turns':>5} {'merged tok':>11} {'per_req tok':>12} {'ratio':>7} {'sampled':>8} "
        f"{'merge tok/s':>12} {'per_req tok/s':>14} {'service tok/s':>14} {'svc out tok/s':>13} "
        f"{'ms/session':>10}"
    )
    for turns in (10, 50, 100):
        r = bench_size(turns, args.sessions)
        print(
            f"{r['turns']:>5} {r['merged']:>11,.0f} {r['per_request']:>12,.0f} "
            f"{r['ratio']:>6.2f}x {r['sampled']:>8,.0f} {r['merge_tok_s']:>12,.0f} "
            f"{r['pr_tok_s']:>14,.0f} {r['service_tok_s']:>14,.0f} {r['service_out_tok_s']:>13,.0f} "
            f"{r['ms_per_session']:>10,.1f}"
        )
    print(fixture_line())
    print(
        "tok/s = per_request-equivalent tokens (every call's prompt + output) assembled per "
        "second; service = build_trajectory + JSON encode (what the service does per session); "
        "svc out = trainer tokens produced per second"
    )


if __name__ == "__main__":
    main()
