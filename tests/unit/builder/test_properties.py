"""Property: any chain of extending prompts merges into one exact trace."""

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import Outcome
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging
from tests.unit.builder.synth import Capture

tokens = st.lists(st.integers(0, 40), max_size=12)
turn = st.tuples(tokens, tokens, st.sampled_from(["stop", "length", "tool_calls"]))


@st.composite
def sessions(draw):
    first_prompt = draw(st.lists(st.integers(0, 40), min_size=1, max_size=20))
    turns = draw(st.lists(turn, min_size=1, max_size=15))
    # every next prompt must be longer than the previous one (the tip's prompt)
    turns = [(out, glue or ([7] if not out else []), fin) for out, glue, fin in turns]
    return first_prompt, turns, draw(st.booleans())


@settings(max_examples=100, deadline=None)
@given(sessions())
def test_extending_prompts_merge_into_one_exact_chain(session):
    prompt, turns, delta = session
    cap = Capture(delta=delta)
    outputs = []
    for i, (out, glue, finish) in enumerate(turns):
        cap.call(prompt, out, finish=finish)
        outputs.append(out)
        if i < len(turns) - 1:
            prompt = prompt + out + glue
    traces, stats, _ = PrefixMerging().build(cap.records, {}, Outcome.COMPLETED)
    assert len(traces) == 1
    (t,) = traces
    assert t.prompt_ids + t.response_ids == prompt + outputs[-1]
    assert sum(t.loss_mask) == sum(len(o) for o in outputs) == stats.sampled_tokens
    assert len(t.loss_mask) == len(t.response_ids) == len(t.response_logprobs)
    assert t.completion_seqs == list(range(len(turns)))
    per_request, _ = PerRequest().build(cap.records, {}, Outcome.COMPLETED)
    assert len(per_request) == len(turns)
    assert stats.tokens <= sum(len(p.prompt_ids) + len(p.response_ids) for p in per_request)
