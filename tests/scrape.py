"""A Prometheus scrape parsed with prometheus-client's own parser, for the metrics tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]
"""{sample name: {sorted (label, value) pairs: value}}."""


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent: a counter not yet incremented)."""
    return samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def families(samples: Samples, prefix: str = "harli_") -> set[str]:
    """The metric families the samples belong to (`_created` series left out)."""
    names = set()
    for name in samples:
        if not name.startswith(prefix) or name.endswith("_created"):
            continue
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix):
                name = name.removesuffix(suffix)
                break
        names.add(name)
    return names
