"""The proxy's per-token work on one chat-mode call of a long conversation: what grows
with the prompt and the answer, which the proxy bench's 20-token prompts never show.

A CLI's calls carry 10-60k-token prompts (its system prompt and tools, then the
history). In chat mode the engine answers with every prompt id and each sampled id with
its logprob, and the proxy then: reads the answer (``orjson`` + ``parse_chat``: parse_ms),
checks that the prompt extends the call before (``judge_chat_prompt``: judge_ms),
builds and encodes the record, whose prompt is stored as a reference to that call plus
the new tail (``build_record`` + ``schemas.encode``: record_ms), and packs the new TITO
state's ids (state_ms; since judging packs the prompt, only the output is left). Each tree (this one, and ``--baseline REF`` as a git worktree)
runs in a process of its own, rounds alternated; medians.

    python tests/bench/bench_engine_answer.py [--baseline REF] [--prompt 2000 20000 60000]
        [--output 500] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.trees import alternated  # noqa: E402

WORKER = r"""
import json, random, sys, time
import orjson
from proxy import capture
from proxy.backends.sglang_wire import parse_chat
from proxy.tito import TurnState, judge_chat_prompt, pack, tools_key
from schemas import Protocol, UpstreamMode, encode


def per_call(fn, budget=0.4):
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        fn()
        n += 1
    return (time.perf_counter() - start) / n * 1000


def packed_prompt(plan):  # as the handler stores it (the plan's own, since judging packs it)
    own = getattr(plan, "packed_prompt", None)
    return own() if own is not None else pack(plan.prompt_ids)


rng = random.Random(0)
out = {}
for n_prompt, n_output in json.loads(sys.argv[1]):
    before = [rng.randrange(150_000) for _ in range(n_prompt - 300)]  # the previous call's
    sampled = [rng.randrange(150_000) for _ in range(200)]
    prompt = before + sampled + [rng.randrange(150_000) for _ in range(100)]  # + a tool result
    output = [rng.randrange(150_000) for _ in range(n_output)]
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "fix the bug"}]
    reply = {"role": "assistant", "content": "looking"}
    request = [*messages, reply, {"role": "user", "content": "a tool's output"}]
    state = TurnState(seq=4, messages=messages, reply=reply, tools_key=tools_key(None),
                      prompt=pack(before), output=pack(sampled))
    meta = {"output_token_logprobs": [[-rng.random(), t, None] for t in output],
            "weight_version": "3", "finish_reason": {"type": "stop"}}
    body = orjson.dumps({"model": "m", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": "done"},
        "finish_reason": "stop", "prompt_token_ids": prompt, "meta_info": meta}]})
    ctx = capture.CallContext(
        session_id="s", attempt=0, protocol=Protocol.OPENAI_CHAT, mode=UpstreamMode.CHAT,
        model="m", raw_request=b"{}", normalized=b"null", user_agent=None, side_call=None,
        received=time.time())
    gen = parse_chat(orjson.loads(body))
    plan = judge_chat_prompt(gen.prompt_ids, request, None, [state])
    assert plan.extends is True and gen.output_ids == output
    record = capture.build_record(ctx, 5, plan, gen)
    assert record.prompt_base_len == n_prompt - 100 and len(record.prompt_ids) == 100
    cells = {
        "parse_ms": per_call(lambda: parse_chat(orjson.loads(body))),
        "judge_ms": per_call(lambda: judge_chat_prompt(gen.prompt_ids, request, None, [state])),
        "record_ms": per_call(lambda: encode(capture.build_record(ctx, 5, plan, gen))),
        "state_ms": per_call(lambda: (packed_prompt(plan), pack(gen.output_ids))),
    }
    cells["total_ms"] = sum(cells.values())
    out[f"{n_prompt}/{n_output}"] = cells
print(json.dumps(out))
"""

COLUMNS = ("parse_ms", "judge_ms", "record_ms", "state_ms", "total_ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", metavar="REF")
    ap.add_argument("--prompt", type=int, nargs="+", default=[2000, 20000, 60000])
    ap.add_argument("--output", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    cases = [(n, args.output) for n in args.prompt]
    labels, runs = alternated(WORKER, cases, args.rounds, args.baseline)
    for label, commit in labels:
        print(f"- {label}: {commit}")
    print(f"\nmedians of {args.rounds} rounds, ms per call\n")
    cols = [(label, key) for key in COLUMNS for label, _ in labels]
    print("| prompt ids | output ids | " + " | ".join(f"{k} {lbl}" for lbl, k in cols) + " |")
    print("|---" * (2 + len(cols)) + "|")
    for n_prompt, n_output in cases:

        def med(label: str, key: str, case: str = f"{n_prompt}/{n_output}") -> float:
            values = sorted(r[case][key] for r in runs[label])
            return values[len(values) // 2]

        cells = " | ".join(f"{med(lbl, k):.3f}" for lbl, k in cols)
        print(f"| {n_prompt} | {n_output} | {cells} |")


if __name__ == "__main__":
    main()
