import json
from pathlib import Path

import pytest

from services.engine.engine import Engine
from services.engine.policy import (
    PolicyError,
    choose_turn,
    load_policy,
    messages_from_prompt,
    scripted_ids,
)
from services.engine.sampling import SamplingParams
from services.engine.sequence import GenerationRequest

POLICIES = Path(__file__).parents[2] / "fixtures" / "policies"


def user(text):
    return {"role": "user", "content": text}


def assistant(text="x"):
    return {"role": "assistant", "content": text}


def test_fixture_policies_load():
    for path in POLICIES.glob("*.yaml"):
        assert load_policy(path).turns, path


def test_positional_turns_follow_the_assistant_count_and_repeat():
    policy = load_policy(POLICIES / "shell_agent.yaml")
    convo = [user("fix it")]
    assert choose_turn(policy, convo).tool_calls[0].arguments == {"command": "ls -la"}
    convo += [assistant(), {"role": "tool", "content": "README.md"}]
    assert choose_turn(policy, convo).tool_calls[0].arguments == {"command": "cat README.md"}
    convo += [assistant(), {"role": "tool", "content": "# hi"}, assistant(), user("again")]
    assert choose_turn(policy, convo).text.endswith("Done.")


def test_cycle_after_last():
    policy = load_policy(POLICIES / "parallel_calls.yaml")
    convo = [user("go"), assistant(), user("more"), assistant(), user("more")]
    assert len(choose_turn(policy, convo).tool_calls) == 2


def test_regex_turns_and_default():
    policy = load_policy(POLICIES / "regex_router.yaml")
    assert choose_turn(policy, [user("What's the weather?")]).tool_calls[0].name == "get_weather"
    assert choose_turn(policy, [user("hello there")]).text.startswith("Hello!")
    assert choose_turn(policy, [user("tell me a joke")]).text == "I only know about the weather."
    parts = {"role": "user", "content": [{"type": "text", "text": "weather please"}]}
    assert choose_turn(policy, [parts]).tool_calls


def test_invalid_policies_are_config_errors(tmp_path):
    bad_regex = tmp_path / "a.yaml"
    bad_regex.write_text("turns:\n  - match: '('\n    text: x\n")
    with pytest.raises(PolicyError, match="bad regex"):
        load_policy(bad_regex)
    unknown = tmp_path / "b.yaml"
    unknown.write_text("turns:\n  - txt: typo\n")
    with pytest.raises(PolicyError):
        load_policy(unknown)
    with pytest.raises(PolicyError):
        load_policy(tmp_path / "missing.yaml")


def test_scripted_ids_are_the_template_rendering_of_the_turn(tok):
    policy = load_policy(POLICIES / "shell_agent.yaml")
    ids = scripted_ids(policy, tok, [user("hi")])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == (
        "<think>\nI should see what is in the working directory first.\n</think>\n\n"
        "Let me look at the files.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call><|im_end|>'
    )
    reply = tok.parse_reply(ids, tools=[{"type": "function", "function": {"name": "bash"}}])
    assert reply.reasoning.startswith("I should") and reply.content == "Let me look at the files."
    assert json.loads(reply.tool_calls[0].arguments) == {"command": "ls -la"}


def test_messages_from_a_rendered_prompt(tok):
    convo = [
        {"role": "system", "content": "s"},
        user("weather?"),
        assistant("ok"),
        {"role": "tool", "content": "sun"},
    ]
    parsed = messages_from_prompt(tok.render(convo))
    assert [m["role"] for m in parsed] == ["system", "user", "assistant", "user"]
    assert parsed[-1]["content"] == "<tool_response>\nsun\n</tool_response>"


def test_engine_emits_forced_ids_with_true_logprobs(model, tok):
    policy = load_policy(POLICIES / "regex_router.yaml")
    messages = [user("How is the weather in Paris?")]
    prompt = tok.render_ids(messages)
    forced = scripted_ids(policy, tok, messages)
    engine = Engine(model, tok.decode, tok.eos_token_ids).start()
    try:
        params = SamplingParams(temperature=1.0, sampling_seed=3)
        result = engine.submit(
            GenerationRequest(rid="s", prompt_ids=prompt, params=params, forced_ids=forced)
        ).result(20)
        short = engine.submit(
            GenerationRequest(
                rid="t",
                prompt_ids=prompt,
                params=SamplingParams(max_new_tokens=3),
                forced_ids=forced,
            )
        ).result(20)
    finally:
        engine.stop()
    assert result.output_ids == forced
    assert result.finish_reason == {"type": "stop", "matched": forced[-1]}
    truth = model.teacher_forced_logprobs(prompt + forced, len(prompt))
    assert max(abs(a - b) for a, b in zip(truth, result.output_logprobs, strict=True)) <= 1e-4
    assert short.output_ids == forced[:3] and short.finish_reason["type"] == "length"
