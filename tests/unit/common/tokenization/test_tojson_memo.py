"""The chat template's memoised ``tojson`` is stdlib ``json.dumps``, call for call."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.tokenization import template

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=JSON, indent=st.sampled_from([None, 2]), sort_keys=st.booleans())
def test_same_output_as_json_dumps_cold_and_warm(value, indent, sort_keys):
    want = json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)
    assert template._tojson(value, indent=indent, sort_keys=sort_keys) == want
    assert template._tojson(value, indent=indent, sort_keys=sort_keys) == want


def test_equal_json_with_other_options_is_not_confused():
    tool = {"name": "bash", "parameters": {"b": 1, "a": [1.0, 2, "é"]}, "pad": "x" * 80}
    plain, indented = template._tojson(tool), template._tojson(tool, indent=2)
    assert plain == json.dumps(tool, ensure_ascii=False) and plain != indented
    assert template._tojson(tool, ensure_ascii=True) == json.dumps(tool)
    assert (
        template._tojson({1: "int keys are not JSON for orjson"})
        == '{"1": "int keys are not JSON for orjson"}'
    )


def test_the_memo_stays_within_its_budget(monkeypatch):
    monkeypatch.setattr(template._dumped, "budget", 5000)
    for i in range(200):
        value = {"i": i, "pad": "y" * 100}
        assert template._tojson(value) == json.dumps(value)
        assert template._dumped.used <= 5000


def test_infinity_is_not_served_from_nones_entry():
    # orjson writes inf as null, the memo's key: the two must still dump apart
    pad = "z" * 80
    assert template._tojson({"a": None, "pad": pad}) == json.dumps({"a": None, "pad": pad})
    for x in (float("inf"), float("-inf")):
        value = {"a": [x], "pad": pad}
        assert template._tojson(value) == json.dumps(value, ensure_ascii=False)
