"""The registry's Lua scripts name their keys through schemas/subjects.py, never by copies
of the prefixes (the scripts themselves run against real Redis in the registry tests)."""

from importlib import resources

import pytest

from schemas import subjects as S
from services.common import registry

SCRIPTS = ("transition.lua", "create_task.lua")


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_sources_hold_no_key_prefix(name):
    source = resources.files("services.common").joinpath(name).read_text()
    assert S.REDIS_PREFIX not in source


def test_inline_scripts_hold_no_key_prefix():
    assert S.REDIS_PREFIX not in registry._RELEASE_OWN
    assert S.REDIS_PREFIX not in registry._TAKE_EXPIRED
    assert S.REDIS_PREFIX not in registry._HOLD


def test_a_function_key_becomes_the_lua_expression_that_builds_it():
    lua = registry.expand_keys("redis.call('SADD', @key_node_state(node, ARGV[1])@, sid)")
    assert lua == "redis.call('SADD', ('polar:node:' .. node .. ':' .. ARGV[1]), sid)"


def test_a_constant_key_becomes_a_lua_literal():
    assert registry.expand_keys("INCR @KEY_TRANSITION_SEQ@") == "INCR 'polar:transition_seq'"


def test_the_scripts_follow_a_changed_key_layout(monkeypatch):
    monkeypatch.setattr(S, "key_token", lambda token: f"other:tok:{token}")
    monkeypatch.setattr(S, "KEY_TRANSITION_SEQ", "other:seq")
    assert "('other:tok:' .. ARGV[b + 1])" in registry._script("create_task.lua")
    transition = registry._script("transition.lua")
    assert "('other:tok:' .. token)" in transition
    assert "'other:seq'" in transition
    assert "@" not in transition


def test_quotes_in_a_key_stay_inside_the_lua_string(monkeypatch):
    monkeypatch.setattr(S, "KEY_TRANSITION_SEQ", "it's\\here")
    assert registry.expand_keys("@KEY_TRANSITION_SEQ@") == "'it\\'s\\\\here'"


def test_an_unknown_name_fails_at_load_not_in_redis():
    with pytest.raises(AttributeError):
        registry.expand_keys("@key_nothing(sid)@")
