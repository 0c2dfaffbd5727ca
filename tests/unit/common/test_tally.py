"""Tallies read as prometheus_client's own Counter and Histogram would: the same text
for the same counts, whatever the order of observation."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.common.tally import CounterFamily, HistogramFamily

BUCKETS = (0.001, 0.01, 0.1, 1, 10)
VALUES = [0.0005, 0.001, 0.002, 0.01, 0.5, 1, 3.5, 10, 11, 250.0, 0.0]


def _text(registry: CollectorRegistry) -> str:
    """The exposition with each ``_created`` timestamp blanked (made at different times)."""
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(registry).decode())


def _pair():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    return ours, theirs


def test_a_counter_family_reads_as_prometheus_clients_counter():
    ours, theirs = _pair()
    tally = CounterFamily("polar_x_total", "Things by kind", ["kind", "result"], registry=ours)
    counter = Counter("polar_x_total", "Things by kind", ["kind", "result"], registry=theirs)
    for kind, result, n in [("a", "ok", 1), ("b", "ok", 2.5), ("a", "ok", 3), ("a", "bad", 1)]:
        tally.labels(kind, result).inc(n)
        counter.labels(kind, result).inc(n)
    tally.labels("c", "ok")  # made, never counted: a zero sample, as theirs gives
    counter.labels("c", "ok")
    assert _text(ours) == _text(theirs)
    assert tally.labels("a", "ok").value == 4


def test_a_histogram_family_reads_as_prometheus_clients_histogram():
    ours, theirs = _pair()
    tally = HistogramFamily("polar_y_seconds", "Time", ["p"], buckets=BUCKETS, registry=ours)
    hist = Histogram("polar_y_seconds", "Time", ["p"], buckets=BUCKETS, registry=theirs)
    for i, v in enumerate(VALUES):  # values on a bound count in that bound's bucket
        label = "even" if i % 2 == 0 else "odd"
        tally.labels(label).observe(v)
        hist.labels(label).observe(v)
    assert _text(ours) == _text(theirs)


def test_wrong_labels_and_negative_increments_are_refused():
    tally = CounterFamily("polar_z_total", "Z", ["kind"], registry=None)
    with pytest.raises(ValueError, match="takes labels"):
        tally.labels("a", "b")
    with pytest.raises(ValueError, match="only go up"):
        tally.labels("a").inc(-1)
    with pytest.raises(ValueError, match="finite bucket"):
        HistogramFamily("polar_w_seconds", "W", [], buckets=[float("inf")], registry=None)


def test_a_name_taken_in_the_registry_is_refused():
    registry = CollectorRegistry()
    Counter("polar_v_total", "V", ["kind"], registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        CounterFamily("polar_v_total", "V", ["kind"], registry=registry)
