"""Counters and histograms for a hot path that runs on one event loop, exported through
prometheus_client's registry.

prometheus_client's ``Counter.inc`` and ``Histogram.observe`` check the metric's state
and take a lock on every call (~0.4 µs each; a proxied model call made seven of them).
Counted here, an increment is an addition to a plain number: nothing else writes it, as
only the loop's thread may count into a tally (the lock guards nothing then). The
registry reads the numbers when scraped, under the same names, labels, help text and
samples (``_total``, ``_bucket``/``_count``/``_sum``, ``_created``) as prometheus_client's
own metric of that kind would give.
"""

from __future__ import annotations

import itertools
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Generic, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

C = TypeVar("C", "CounterTally", "HistogramTally")


class CounterTally:
    """A counter child: ``inc`` adds, ``value`` is the sum so far."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class HistogramTally:
    """A histogram child: ``observe`` counts a value into the first bucket it fits
    (``counts`` per bucket, not cumulative; the last bucket is +Inf)."""

    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a bound is the bucket's ``le``
        self.sum += value


class _Family(Generic[C]):
    """The labelled children of one metric, each made by ``new_child`` when its label
    values are first asked for; each kind's ``collect`` reads them for the registry."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None,
        new_child: Callable[[], C],
    ) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], C] = {}
        self._new_child = new_child
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> C:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self.children[values] = self._new_child()
        return child

    def describe(self) -> list[Metric]:  # what the registry checks names against
        return list(self.collect())  # type: ignore[attr-defined]  # each kind's own


class CounterFamily(_Family[CounterTally]):
    """``Counter(name, documentation, labelnames)`` as prometheus_client has it, its
    children ``CounterTally``. ``name`` may end in ``_total`` (the family's name is
    without it, as prometheus_client does)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        super().__init__(
            name.removesuffix("_total"), documentation, labelnames, registry, CounterTally
        )

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self.children.items()):
            family.add_metric(values, child.value, created=child.created)
        yield family


class HistogramFamily(_Family[HistogramTally]):
    """``Histogram(name, documentation, labelnames, buckets=...)`` as prometheus_client
    has it (+Inf added), its children ``HistogramTally``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        if not bounds:
            raise ValueError("a histogram needs at least one finite bucket")
        self.le = [floatToGoString(b) for b in bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry, partial(HistogramTally, bounds))

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self.children.items()):
            cumulative = list(zip(self.le, itertools.accumulate(child.counts), strict=True))
            family.add_metric(values, cumulative, child.sum)
            labels = dict(zip(self.labelnames, values, strict=True))
            family.samples.append(Sample(self.name + "_created", labels, child.created))
        yield family
