"""A replayed request against the recorded one: where they differ, and whether only by
nondeterminism (dates, timestamps, ids, timings)."""

import time

import orjson
import pytest

from proxy.replay_diff import NONDETERMINISM, Difference, RequestDiff, explain, request_diff

SYSTEM = (
    "You are Claude Code, Anthropic's official CLI for Claude.\n"
    "<env>\nWorking directory: /repo\nPlatform: linux\nToday's date is 2026-12-06\n</env>\n"
    "Be concise."
)
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    },
}


def call(i: int, cmd: str) -> dict:
    args = orjson.dumps({"cmd": cmd}).decode()
    fn = {"name": "bash", "arguments": args}
    return {"id": f"call_{i}", "type": "function", "function": fn}


def conversation(system: str = SYSTEM, output: str = "total 0\n", cmd: str = "ls -la") -> dict:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "", "tool_calls": [call(0, cmd)]},
            {"role": "tool", "tool_call_id": "call_0", "content": output},
        ],
        "tools": [BASH],
    }


def diff(recorded: dict, now: dict, **kw) -> RequestDiff | None:
    return request_diff(orjson.dumps(recorded), orjson.dumps(now), **kw)


def only(d: RequestDiff | None) -> Difference:
    assert d is not None
    assert len(d.differences) == 1, d.describe()
    return d.differences[0]


def test_equal_values_are_no_difference_whatever_the_key_order_and_whitespace():
    doc = conversation()
    reordered = {
        "tools": [{"function": dict(reversed(BASH["function"].items())), "type": "function"}],
        "messages": [dict(reversed(m.items())) for m in doc["messages"]],
    }
    spaced = orjson.dumps(reordered, option=orjson.OPT_INDENT_2)
    assert spaced != orjson.dumps(doc)
    assert request_diff(orjson.dumps(doc), spaced) is None
    assert request_diff(orjson.dumps(doc), orjson.dumps(doc)) is None


def test_json_equality_tells_true_from_1():
    d = request_diff(
        b'{"messages": [], "tools": [{"strict": true}]}',
        b'{"tools": [{"strict": 1}], "messages": []}',
    )
    assert d is not None
    assert only(d).path == "tools[0].strict" and only(d).kind == "type"
    assert request_diff(b'{"n": 1}', b'{"n": 1.0}') is None  # the same number


def test_a_changed_system_prompt_is_shown_where_it_changed():
    d = diff(conversation(), conversation(system=SYSTEM.replace("Be concise.", "Be verbose.")))
    first = only(d)
    assert (first.path, first.kind) == ("messages[0].content", "changed")
    assert first.nondeterministic == [] and not d.only_nondeterministic
    assert first.recorded.startswith("…") and "Be concise." in first.recorded
    assert "Be verbose." in first.now and "Be concise." not in first.now
    assert len(first.recorded) <= 160 and len(first.now) <= 160


def test_a_new_date_in_the_system_prompt_is_nondeterminism():
    d = diff(conversation(), conversation(system=SYSTEM.replace("2026-12-06", "2026-12-07")))
    first = only(d)
    assert first.path == "messages[0].content"
    assert first.nondeterministic == ["date"]
    assert d.only_nondeterministic
    assert "Today's date is 2026-12-06" in first.recorded
    assert "Today's date is 2026-12-07" in first.now


def test_a_date_with_other_changes_is_not_only_nondeterminism():
    changed = SYSTEM.replace("2026-12-06", "2026-12-07").replace("linux", "darwin")
    d = diff(conversation(), conversation(system=changed))
    assert only(d).nondeterministic == [] and not d.only_nondeterministic


def test_a_timestamp_in_a_tool_result():
    d = diff(
        conversation(output="created_at: 1733580000\nstatus: ok\n"),
        conversation(output="created_at: 1765116263\nstatus: ok\n"),
    )
    first = only(d)
    assert first.path == "messages[3].content"
    assert first.nondeterministic == ["timestamp"] and d.only_nondeterministic


def test_a_uuid():
    d = diff(
        conversation(output="session 123e4567-e89b-12d3-a456-426614174000 started"),
        conversation(output="session 9b2f0c1e-4d3a-4f5e-8a7b-6c5d4e3f2a1b started"),
    )
    assert only(d).nondeterministic == ["UUID"] and d.only_nondeterministic


def test_a_duration_in_a_tool_output():
    d = diff(
        conversation(output="===== 12 passed in 0.12s =====\n"),
        conversation(output="===== 12 passed in 0.31s =====\n"),
    )
    assert only(d).nondeterministic == ["duration"] and d.only_nondeterministic
    # the count of tests is no duration
    d = diff(
        conversation(output="===== 12 passed in 0.12s =====\n"),
        conversation(output="===== 11 passed in 0.12s =====\n"),
    )
    assert not d.only_nondeterministic


def test_an_added_message_reads_as_one_addition():
    now = conversation()
    now["messages"].append({"role": "user", "content": "And the hidden ones?"})
    first = only(diff(conversation(), now))
    assert (first.path, first.kind, first.recorded) == ("messages[4]", "added", "")
    assert "hidden ones" in first.now
    # inserted in the middle: still one addition, at its index
    now = conversation()
    now["messages"].insert(1, {"role": "user", "content": "Hello."})
    first = only(diff(conversation(), now))
    assert (first.path, first.kind) == ("messages[1]", "added")


def test_a_removed_message():
    now = conversation()
    del now["messages"][3]
    d = diff(conversation(), now)
    first = only(d)
    assert (first.path, first.kind, first.now) == ("messages[3]", "removed", "")
    assert "call_0" in first.recorded and not d.only_nondeterministic


def test_a_changed_tool_description():
    now = conversation()
    now["tools"] = [
        {"type": "function", "function": {**BASH["function"], "description": "Run it."}}
    ]
    first = only(diff(conversation(), now))
    assert (first.path, first.kind) == ("tools[0].function.description", "changed")
    assert (first.recorded, first.now) == ("Run a shell command.", "Run it.")


def test_a_changed_tool_call_argument():
    first = only(diff(conversation(), conversation(cmd="ls -l")))
    assert first.path == "messages[2].tool_calls[0].function.arguments"
    assert first.recorded == '{"cmd":"ls -la"}' and first.now == '{"cmd":"ls -l"}'
    assert first.nondeterministic == []


def test_list_of_parts_content():
    def parts(text: str) -> dict:
        doc = conversation()
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}}
        doc["messages"][1]["content"] = [image, {"type": "text", "text": text}]
        return doc

    d = diff(
        parts("Generated at Mon Dec  7 2026, look."), parts("Generated at Tue Dec  8 2026, look.")
    )
    first = only(d)
    assert first.path == "messages[1].content[1].text"
    assert first.nondeterministic == ["date"]
    # a string that became a list of parts is a change of type
    first = only(diff(conversation(), parts("List the files.")))
    assert (first.path, first.kind) == ("messages[1].content", "type")
    assert first.recorded == '"List the files."' and first.now.startswith("[")


def test_the_limit_keeps_the_first_differences_in_document_order():
    recorded = {"messages": [{"role": "user", "content": f"step {i}"} for i in range(10)]}
    now = {"messages": [{"role": "user", "content": f"stage {i}"} for i in range(10)]}
    d = diff(recorded, now, limit=3)
    assert [x.path for x in d.differences] == [f"messages[{i}].content" for i in range(3)]
    assert d.more == 7 and not d.only_nondeterministic
    assert "and 7 more" in d.describe()
    assert len(diff(recorded, now).differences) == 5  # the default


def test_differences_past_the_limit_still_decide_only_nondeterministic():
    recorded = {"messages": [{"role": "user", "content": "at 2026-12-06"}] * 3}
    now = {"messages": [{"role": "user", "content": "at 2026-12-07"}] * 3}
    assert diff(recorded, now, limit=1).only_nondeterministic
    now["messages"] = [*now["messages"][:2], {"role": "user", "content": "at home"}]
    d = diff(recorded, now, limit=1)
    assert d.differences[0].nondeterministic == ["date"] and d.more == 2
    assert not d.only_nondeterministic


@pytest.mark.parametrize(
    ("recorded", "now", "names"),
    [
        ("at 2026-12-07T14:03:22Z", "at 2026-12-08T09:00:01.5+01:00", ["datetime"]),
        ("on December 7, 2026.", "on December 8, 2026.", ["date"]),
        ("on 7 Dec 2026.", "on 8 Dec 2026.", ["date"]),
        ("on 12/07/2026.", "on 12/08/2026.", ["date"]),
        ("-rw-r--r-- 1 u u 12 Dec  7 14:03 a", "-rw-r--r-- 1 u u 12 Dec  8 09:11 a", ["datetime"]),
        ("at 14:03 and 14:03:22", "at 15:10 and 15:10:01", ["clock time"]),
        ("t=1733580000123", "t=1765116263000", ["timestamp"]),
        ("HEAD is 3f2a9c1d8e7b6a5f4e3d", "HEAD is 9e1b0c2d3a4f5e6d7c8b", ["hex id"]),
        ("cd /tmp/tmp8x_k2js && ls", "cd /tmp/tmpq9w_e3rt && ls", ["temp path"]),
        ("/tmp/pytest-of-root/pytest-12/t0", "/tmp/pytest-of-root/pytest-13/t0", ["temp path"]),
        ("took 153 ms", "took 97 ms", ["duration"]),
        ("real 1.234s", "real 2.5s", ["duration"]),
        ("2026-12-06 took 5 ms", "2026-12-07 took 9 ms", ["date", "duration"]),
        # not nondeterminism
        ("ls -la", "ls -l", None),
        ("file.py:12:34: error", "file.py:12:35: error", None),
        ("wait 5 minutes", "wait 6 minutes", None),
        ("order 123456789012", "order 123456789013", None),
        ("/tmp/foo.txt", "/tmp/bar.txt", None),
        ("version 1.2.3", "version 1.2.4", None),
        ("on 2026-12-06", "on Dec 7, 2026 too", None),
    ],
)
def test_what_counts_as_nondeterminism(recorded, now, names):
    assert explain(recorded, now) == names


def test_patterns_are_named_once():
    names = [name for name, _ in NONDETERMINISM]
    assert len(names) == len(set(names))
    assert {
        "date",
        "datetime",
        "clock time",
        "timestamp",
        "UUID",
        "hex id",
        "temp path",
        "duration",
    } <= set(names)


def test_describe_says_where_and_what():
    d = diff(conversation(), conversation(system=SYSTEM.replace("2026-12-06", "2026-12-07")))
    text = d.describe()
    assert "in 1 place: messages[0].content: recorded '…" in text
    assert "Today's date is 2026-12-06\\n</env>" in text  # newlines shown escaped
    assert ", now '…" in text and "Today's date is 2026-12-07" in text
    assert "(a date)" in text and "nondeterminism" in text
    now = conversation(cmd="ls -l")
    now["messages"].append({"role": "user", "content": "more"})
    text = diff(conversation(), now).describe()
    assert "in 2 places" in text and "nondeterminism" not in text
    assert "messages[2].tool_calls[0].function.arguments: recorded" in text
    assert 'messages[4]: added \'{"role":"user","content":"more"}\'' in text


def big_document(stamp: str, output_stamp: str) -> bytes:
    filler = "lorem ipsum dolor sit amet, 42 consectetur adipiscing elit\n" * 20
    messages = [{"role": "system", "content": SYSTEM.replace("2026-12-06", stamp)}]
    for i in range(300):
        messages.append({"role": "user", "content": [{"type": "text", "text": filler}]})
        messages.append({"role": "assistant", "content": "ok", "tool_calls": [call(i, "ls -la")]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": filler})
    log = filler * 100  # one 100 KB tool output with a new timestamp in its middle
    messages.append({"role": "tool", "content": f"{log}finished at {output_stamp}\n{log}"})
    return orjson.dumps({"messages": messages, "tools": [BASH] * 20})


def test_a_1mb_request_is_compared_fast():
    recorded = big_document("2026-12-06", "2026-12-06T10:00:00Z")
    now = big_document("2026-12-07", "2026-12-07T11:02:03Z")
    assert len(recorded) > 1_000_000
    request_diff(recorded, now)  # warm up
    took = []
    for _ in range(3):
        start = time.perf_counter()
        d = request_diff(recorded, now)
        took.append(time.perf_counter() - start)
    assert [x.path for x in d.differences] == ["messages[0].content", "messages[901].content"]
    assert d.only_nondeterministic
    start = time.perf_counter()
    assert request_diff(recorded, recorded.replace(b'"ok"', b'"ok" ')) is None
    took.append(time.perf_counter() - start)
    assert max(took) < 0.2, took


@pytest.mark.parametrize("now", ["Chunk ID: 42039d", "Chunk ID: 703245"])
def test_a_labelled_short_id_is_nondeterminism(now):
    """Codex's exec output names each chunk with a random id of 6 hex digits."""
    recorded = {
        "messages": [{"role": "tool", "content": "Chunk ID: 7032d2\nWall time: 0.0000 seconds"}]
    }
    later = {"messages": [{"role": "tool", "content": f"{now}\nWall time: 0.0000 seconds"}]}
    diff = request_diff(orjson.dumps(recorded), orjson.dumps(later))
    assert diff is not None and diff.only_nondeterministic
    assert diff.differences[0].nondeterministic == ["labelled id"]


def test_a_git_commit_made_at_the_sessions_start_is_nondeterminism():
    """Claude Code lists the repository's recent commits; a fresh runtime makes new ones."""
    text = "Status:\n(clean)\n\nRecent commits:\n{} polar baseline\n\nClaude Code"
    recorded = {"messages": [{"role": "user", "content": text.format("1d13296")}]}
    for sha in ("6c1a956", "7034521"):
        now = {"messages": [{"role": "user", "content": text.format(sha)}]}
        diff = request_diff(orjson.dumps(recorded), orjson.dumps(now))
        assert diff is not None and diff.differences[0].nondeterministic == ["git commit"]
    words = {"messages": [{"role": "user", "content": text.format("1d13296 Polar")}]}
    assert not request_diff(orjson.dumps(recorded), orjson.dumps(words)).only_nondeterministic
