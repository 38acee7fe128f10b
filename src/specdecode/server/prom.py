"""Prometheus text exposition format (version 0.0.4), written by hand: counters, gauges, histograms.

Thread-safe: the generation worker and the event loop both update metrics. A metric's labelled
series are created on first use; `render()` writes every metric with its HELP and TYPE lines.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + pairs + "}"


class _Metric:
    type_name = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def _header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape(self.help)}", f"# TYPE {self.name} {self.type_name}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    type_name = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self._values: dict[LabelValues, float] = {}
        if not self.label_names:
            self._values[()] = 0.0  # an unlabelled counter is exported from the start, at 0

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        lines = self._header()
        lines += [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items]
        return lines


class Gauge(_Metric):
    """A value read at scrape time from `read()` (e.g. the queue's current depth)."""

    type_name = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float]) -> None:
        super().__init__(name, help)
        self.read = read

    def render(self) -> list[str]:
        return [*self._header(), f"{self.name} {_number(self.read())}"]


class Histogram(_Metric):
    type_name = "histogram"

    def __init__(
        self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> None:
        super().__init__(name, help, labels)
        self.bounds = sorted(float(b) for b in buckets)
        # per label values: [count in each bucket (non-cumulative), ..., count above], sum
        self._series: dict[LabelValues, tuple[list[int], float]] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts, total = self._series.get(key, ([0] * (len(self.bounds) + 1), 0.0))
            counts[bisect.bisect_left(self.bounds, value)] += 1  # le is inclusive
            self._series[key] = (counts, total + value)

    def count(self, **labels: str) -> int:
        with self._lock:
            series = self._series.get(self._key(labels))
        return sum(series[0]) if series else 0

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, (list(c), s)) for k, (c, s) in self._series.items())
        lines = self._header()
        for key, (counts, total) in items:
            cumulative = 0
            for bound, n in zip([*self.bounds, math.inf], counts, strict=True):
                cumulative += n
                names, values = (*self.label_names, "le"), (*key, _number(bound))
                lines.append(f"{self.name}_bucket{_labels(names, values)} {cumulative}")
            base = _labels(self.label_names, key)
            lines.append(f"{self.name}_sum{base} {_number(total)}")
            lines.append(f"{self.name}_count{base} {cumulative}")
        return lines


M = TypeVar("M", bound=_Metric)


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: M) -> M:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"
