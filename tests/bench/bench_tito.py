"""The proxy's per-call work on a session's stored TITO states, as a conversation grows
(issue 18): a model call reads the session's stored states (up to ``MAX_STATES``, 8),
decodes them (or finds them decoded: ``proxy.capture.DecodedStates``, read_ms) and
finds the one it continues (``proxy.tito.best_continued``) before its
record says whether it extended. The proxy bench's calls are two messages long; an
agent's are hundreds. ``--stored`` says how many of the last turns' states the session
holds: 8 when every call pushed a snapshot, 2 since a continued state supersedes its
own base (``proxy.capture.superseded``); both are measured in one run by default.

Each tree (this one, and ``--baseline REF`` as a git worktree) runs in a process of its
own, rounds alternated. A conversation of N tool-calling turns (a system prompt, a task,
then N assistant calls with 40-line tool results), its last 8 turns stored as states
(encoded as the proxy stores them), and the next request: the harness's echo of the
history as it sent it, and one with every call id rewritten (equal only as the model
sees it, so no whole-list equality).

    python tests/bench/bench_tito.py [--baseline REF] [--turns 10 50 100 200]
        [--stored 8 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.trees import alternated  # noqa: E402

WORKER = r"""
import json, sys, time
import orjson
from proxy.capture import decode_states, SessionStore
from proxy.tito import TurnState, best_continued, pack, tools_key
import proxy.capture as capture

TOOLS = [{"type": "function", "function": {"name": "exec_command", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]
KEY = tools_key(TOOLS)


def conversation(turns):
    m = [{"role": "system", "content": "You are a coding agent. " * 50},
         {"role": "user", "content": "fix the bug in the parser"}]
    for i in range(turns):
        args = orjson.dumps({"cmd": f"sed -n {i},{i + 40}p src/parser.py"}).decode()
        m.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function",
             "function": {"name": "exec_command", "arguments": args}}]})
        m.append({"role": "tool", "tool_call_id": f"c{i}", "content": "a line of output\n" * 40})
    return m


def stored(state):  # as SessionStore.remember stores it
    encoder = getattr(capture, "encode_state", None)
    return encoder(state) if encoder else b"%d:%s" % (state.seq, capture._encoder.encode(state))


def per_call(fn, budget=0.3):
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        fn()
        n += 1
    return (time.perf_counter() - start) / n * 1000


out = {}
for turns, count in json.loads(sys.argv[1]):
    full = conversation(turns)
    raw = []
    for k in range(count):  # the last turns' states, newest first
        n = len(full) - 1 - 2 * k
        raw.append(stored(TurnState(seq=1000 - k, messages=full[:n], reply=full[n],
            tools_key=KEY, prompt=pack([1] * 64 * n), output=pack([2] * 16))))
    request = orjson.loads(orjson.dumps(full + [{"role": "user", "content": "go on"}]))
    rewritten = orjson.loads(orjson.dumps(request))
    for m in rewritten:
        for c in m.get("tool_calls") or []:
            c["id"] = "x" + c["id"]
    states = decode_states(raw)
    cache = capture.DecodedStates() if hasattr(capture, "DecodedStates") else None
    if cache is not None:  # warm, as after the proxy stored them or read them once
        cache.decode("s", 0, raw)
    copies = [[bytes(bytearray(r)) for r in raw] for _ in range(8)]  # each read's own bytes

    def read():  # what a call does with the states its lookup brought
        for fresh in copies:
            cache.decode("s", 0, fresh) if cache is not None else decode_states(fresh)

    assert best_continued(request, KEY, states).seq == 1000
    assert best_continued(rewritten, KEY, states).seq == 1000
    out[f"{turns}/{count}"] = {
        "stored_kb": sum(map(len, raw)) / 1024,
        "decode_ms": per_call(lambda: decode_states(raw)),
        "read_ms": per_call(read) / len(copies),
        "continue_ms": per_call(lambda: best_continued(request, KEY, states)),
        "continue_rewritten_ms": per_call(lambda: best_continued(rewritten, KEY, states)),
    }
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", metavar="REF")
    ap.add_argument("--turns", type=int, nargs="+", default=[10, 50, 100, 200])
    ap.add_argument("--stored", type=int, nargs="+", default=[8, 2])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    cases = [(t, n) for t in args.turns for n in args.stored]
    labels, runs = alternated(WORKER, cases, args.rounds, args.baseline)
    for label, commit in labels:
        print(f"- {label}: {commit}")
    print(f"\nmedians of {args.rounds} rounds, ms per call\n")
    cols = [(label, key) for key in ("decode_ms", "read_ms", "continue_ms", "continue_rewritten_ms")
            for label, _ in labels]  # fmt: skip
    head = " | ".join(f"{k} {lbl}" for lbl, k in cols)
    print(f"| turns | states | read kB | {head} |")
    print("|---" * (3 + len(cols)) + "|")
    for t, n in cases:

        def med(label, key, case=f"{t}/{n}"):
            values = sorted(r[case][key] for r in runs[label])
            return values[len(values) // 2]

        kb = med(labels[-1][0], "stored_kb")
        cells = " | ".join(f"{med(lbl, k):.3f}" for lbl, k in cols)
        print(f"| {t} | {n} | {kb:.0f} | {cells} |")


if __name__ == "__main__":
    main()
