"""Token mode's prompt building on real CLI prompts: whole-text encoding vs the segment
cache (``services/common/tokenization/segments.py``), side by side in one run; then the recorded
sessions replayed through ``plan_token_prompt`` as the proxy plans each call.

    python tests/bench/bench_tokenize.py [--rounds 5] [--families]

``--families``: the same recorded sessions planned with each model family's real
vocabulary and official template (``tests/helpers/model_families.py``) beside the tiny
model's (Polar's ChatML template), as the proxy runs (caches warm, heads ahead).

Prompts: every call in the recorded fixtures (Claude Code, Codex, opencode, Gemini CLI;
12-22k tokens each), rendered with the tiny model's template. "first sight" is a
prompt whose system prompt and tools the cache has not seen (a fresh proxy); "seen" is
every later call with the same opening (every other session of the same CLI).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.common.tokenization import ChatTokenizer, TemplateRenderError  # noqa: E402
from services.common.tokenization.segments import SegmentEncoder  # noqa: E402
from tests.unit.engine.tiny import tiny_model_dir  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "completions"


def prompts(tok: ChatTokenizer) -> dict[str, list[str]]:
    out = {}
    for name in ("sub_agent", "compaction", "side_calls", "side_calls_router"):
        texts = []
        for line in (FIXTURES / f"{name}.jsonl").read_bytes().splitlines():
            norm = orjson.loads(line)["normalized"]
            texts.append(tok.render(norm["messages"], norm["tools"] or None))
        out[name] = texts
    return out


def timed(fn, text: str) -> float:
    start = time.perf_counter()
    fn(text)
    return (time.perf_counter() - start) * 1000


def replay(
    tok: ChatTokenizer, name: str, ahead: bool = False, kinds: dict[str, int] | None = None
) -> list[tuple[str, float, bool]]:
    """(kind, ms, exact) per call of a recorded session, planned as the proxy would: each
    call sees the turn states of the calls before it. ``ahead``: each answered call's
    head text is rendered after its answer (as the proxy does, off the next call's path)."""
    import msgspec

    from proxy.tito import MAX_STATES, TurnState, head_text, pack, plan_token_prompt, tools_key
    from schemas import CompletionRecord
    from schemas.completion import reconstruct_prompts

    lines = (FIXTURES / f"{name}.jsonl").read_bytes().splitlines()
    recs = [msgspec.json.decode(line, type=CompletionRecord) for line in lines]
    convs = [orjson.loads(bytes(r.normalized)) for r in recs]
    prompts, states, out = reconstruct_prompts(recs), [], []
    heads: dict[int, str] = {}
    for i, (rec, conv) in enumerate(zip(recs, convs, strict=True)):
        msgs, tools = conv["messages"], conv["tools"] or None
        start = time.perf_counter()
        try:
            plan = plan_token_prompt(tok, msgs, tools, states, heads=lambda st: heads.get(st.seq))
        except TemplateRenderError:  # e.g. Llama 3.1's one call a turn: the proxy's 400
            if kinds is not None:
                kinds["refused"] = kinds.get("refused", 0) + 1
            continue
        ms = (time.perf_counter() - start) * 1000
        if kinds is not None:
            kind = "first" if not states else ("extends" if plan.extends else "breaks")
            kinds[kind] = kinds.get(kind, 0) + 1
        out.append(
            (
                "continuing" if plan.extends else "not continuing",
                ms,
                plan.prompt_ids == prompts[rec.seq],
            )
        )
        # the reply this call sent is what a later request of its conversation echoes
        nxt = next((c["messages"][len(msgs)] for c in convs[i + 1 :]
                    if c["messages"][: len(msgs)] == msgs and len(c["messages"]) > len(msgs)), None)  # fmt: skip
        if nxt is not None:
            state = TurnState(seq=rec.seq, messages=msgs, reply=nxt, tools_key=tools_key(tools),
                              prompt=pack(prompts[rec.seq]), output=pack(rec.output_ids))  # fmt: skip
            states = [state, *states][:MAX_STATES]
            if ahead:
                with contextlib.suppress(TemplateRenderError):  # as the proxy does
                    heads[rec.seq] = head_text(tok, state, tools)
    return out


SESSIONS = ("sub_agent", "compaction", "side_calls", "side_calls_router")
FAMILIES = ("qwen3", "qwen3_5", "llama3_1", "gpt_oss", "deepseek_v3", "mistral")


def families(rounds: int) -> None:
    """Per family: the recorded sessions planned as the proxy plans them (caches warm
    after the first round, heads rendered ahead), beside the tiny model's template."""
    from tests.helpers.model_families import family_model_dir

    models = {"polar ChatML (tiny)": tiny_model_dir()}
    models.update({name: family_model_dir(name) for name in FAMILIES})
    rows = []
    for label, model_dir in models.items():
        tok = ChatTokenizer.load(model_dir)
        first, later, tokens, kinds = [], [], [], {}
        for i in range(rounds):
            for name in SESSIONS:
                for kind, ms, _ in replay(tok, name, ahead=True, kinds=kinds if i == 0 else None):
                    if i:  # the first round warms the caches, as a proxy's first session
                        (later if kind == "continuing" else first).append(ms)
        cold = []  # a CLI's first prompt, rendered and tokenized by a fresh proxy
        for name in SESSIONS:
            line = (FIXTURES / f"{name}.jsonl").read_bytes().splitlines()[0]
            norm = orjson.loads(line)["normalized"]
            tok.segments = SegmentEncoder.for_tokenizer(tok.tokenizer)
            start = time.perf_counter()
            ids = tok.render_ids(norm["messages"], norm["tools"] or None)
            cold.append((time.perf_counter() - start) * 1000)
            tokens.append(len(ids))
        rows.append((label, tok.family.name, tokens, cold, first, later, kinds))
    print(f"plan_token_prompt per family, {rounds} rounds (the first warms the caches):")
    print("| model | family | first prompts (tokens) | first sight ms | continuing p50 ms "
          "| max ms | not continuing p50 ms | max ms | calls: extend / break / refused |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for label, fam, tokens, cold, first, later, kinds in rows:
        cells = [
            f"{statistics.median(x):.2f} | {max(x):.2f}" if x else "- | -" for x in (later, first)
        ]
        sight = f"{min(cold):.1f}-{max(cold):.1f}"
        print(f"| {label} | {fam} | {min(tokens)}-{max(tokens)} | {sight} | {cells[0]} | {cells[1]} "
              f"| {kinds.get('extends', 0)} / {kinds.get('breaks', 0)} / "
              f"{kinds.get('refused', 0)} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--families", action="store_true", help="each model family's template")
    args = ap.parse_args()
    if args.families:
        families(args.rounds)
        return
    tok = ChatTokenizer.load(tiny_model_dir())
    by_cli = prompts(tok)

    def whole(text):
        return tok.tokenizer.encode(text, add_special_tokens=False).ids

    rows = {"whole text": [], "segments, first sight": [], "segments, seen": []}
    tokens = []
    for _ in range(args.rounds):
        for texts in by_cli.values():
            enc = SegmentEncoder.for_tokenizer(tok.tokenizer)  # a fresh proxy's cache
            for i, text in enumerate(texts):
                rows["whole text"].append(timed(whole, text))
                kind = "segments, first sight" if i == 0 else "segments, seen"
                rows[kind].append(timed(enc.encode, text))
                tokens.append(len(whole(text)))
    print(f"{len(tokens) // args.rounds} prompts x {args.rounds} rounds, "
          f"{min(tokens)}-{max(tokens)} tokens (median {statistics.median(tokens):.0f})")  # fmt: skip
    print("| encoding | prompts | p50 ms | max ms |")
    print("|---|---|---|---|")
    for name, xs in rows.items():
        print(f"| {name} | {len(xs)} | {statistics.median(xs):.2f} | {max(xs):.2f} |")

    # "plain": whole-text encoding and stdlib tojson every time (as before the caches);
    # "cached": with the caches, empty before round 1 ("first session" of each CLI) and
    # kept after ("later sessions": a proxy serving many sessions); "heads ahead": as
    # the proxy runs now, each call's head text rendered after its answer.
    from services.common.tokenization import template

    planned: dict[tuple[str, str], list[float]] = {}
    exact = True
    memo_min, warm = template.MEMO_MIN_BYTES, SegmentEncoder.for_tokenizer(tok.tokenizer)
    template._dumped.clear()
    for i in range(args.rounds):
        for setup in ("plain", "cached", "heads ahead"):
            tok.segments = warm if setup != "plain" else None
            template.MEMO_MIN_BYTES = memo_min if setup != "plain" else 1 << 60
            label = {
                "plain": "plain",
                "cached": ("cached, first session", "cached, later sessions")[i > 0],
                "heads ahead": "cached, later sessions, heads ahead",  # warm: after "cached"
            }[setup]
            for name in by_cli:
                for kind, ms, ok in replay(tok, name, ahead=setup == "heads ahead"):
                    planned.setdefault((kind, label), []).append(ms)
                    exact = exact and ok
    tok.segments, template.MEMO_MIN_BYTES = warm, memo_min
    print(f"\nplan_token_prompt over the recorded sessions (prompts exact: {exact}):")
    print("| call | caches | calls | p50 ms | max ms | total s |")
    print("|---|---|---|---|---|---|")
    for (kind, setup), xs in sorted(planned.items()):
        print(f"| {kind} | {setup} | {len(xs)} | {statistics.median(xs):.2f} | {max(xs):.2f} "
              f"| {sum(xs) / 1000:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
