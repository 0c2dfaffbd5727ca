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

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


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


class _Family:
    kind = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], CounterTally | HistogramTally] = {}
        if registry is not None:
            registry.register(self)

    def _child(self, values: tuple[str, ...]):
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self._new()
        return child

    def _new(self):
        raise NotImplementedError

    def describe(self) -> list[Metric]:  # what the registry checks names against
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError


class CounterFamily(_Family):
    """``Counter(name, documentation, labelnames)`` as prometheus_client has it, its
    children ``CounterTally``. ``name`` may end in ``_total`` (the family's name is
    without it, as prometheus_client does)."""

    def __init__(self, name: str, *args, **kwargs) -> None:
        super().__init__(name.removesuffix("_total"), *args, **kwargs)

    def labels(self, *values: str) -> CounterTally:
        return self._child(values)

    def _new(self) -> CounterTally:
        return CounterTally()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self.children.items()):
            family.add_metric(values, child.value, created=child.created)
        yield family


class HistogramFamily(_Family):
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
        self.bounds = bounds
        self.le = [floatToGoString(b) for b in bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> HistogramTally:
        return self._child(values)

    def _new(self) -> HistogramTally:
        return HistogramTally(self.bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self.children.items()):
            counts, total, cumulative = list(child.counts), child.sum, []
            running = 0
            for le, count in zip(self.le, counts, strict=True):
                running += count
                cumulative.append((le, running))
            family.add_metric(values, cumulative, total)
            labels = dict(zip(self.labelnames, values, strict=True))
            family.samples.append(Sample(self.name + "_created", labels, child.created))
        yield family
