"""Prometheus' text exposition format, one parser for the tools, the benchmark and the tests: sample lines as
written (a Triton counter without `_total` keeps its name); comments and blank lines skipped."""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)

    def matches(self, name: str, labels: dict[str, str]) -> bool:
        return self.name == name and all(self.labels.get(k) == v for k, v in labels.items())


def parse(text: str) -> list[Sample]:
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or line.lstrip().startswith("#"):
            continue
        labels = {k: re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], v)
                  for k, v in _LABEL.findall(match.group(2) or "")}
        samples.append(Sample(match.group(1), float(match.group(3)), labels))
    return samples


def scrape(url: str, timeout_s: float = 30) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse(response.read().decode())


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of `name` over every sample whose labels include `labels`."""
    return sum(s.value for s in samples if s.matches(name, labels))


def maximum(samples: list[Sample], name: str, **labels: str) -> float:
    return max((s.value for s in samples if s.matches(name, labels)), default=0.0)


def label_names(samples: list[Sample]) -> dict[str, set[str]]:
    """Each sample name, with the label names it carries."""
    found: dict[str, set[str]] = defaultdict(set)
    for s in samples:
        found[s.name] |= set(s.labels)
    return dict(found)
