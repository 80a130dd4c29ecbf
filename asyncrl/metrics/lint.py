"""Lint of a text exposition against asyncrl's metric naming rules (:func:`lint_exposition`)."""

from __future__ import annotations

import re


#: Unit spellings that are not base units (promtool 2.42 flags only some of them).
_BAD_UNIT = re.compile(r"(_ms|_us|_ns|_millis|_milliseconds|_minutes|_hours|_kb|_mb|_gb|_kib|_mib|_gib|_percent|_pct)(_|$)")
#: Labels whose values are unbounded (one series per sample/request/prompt).
_BAD_LABELS = frozenset({"sample_id", "request_id", "rid", "group_id", "prompt", "prompt_id", "text", "user", "step", "version"})
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def lint_exposition(text: str, exempt_prefixes: tuple[str, ...] = ("sglang:",)) -> list[str]:
    """Check a text exposition against asyncrl's naming rules; returns the problems (empty: clean).

    Complements ``promtool check metrics`` (which misses ``_gib``/``_percent`` and label
    cardinality): every family is ``asyncrl_``-prefixed snake_case without colons, uses no
    abbreviated or non-base unit, counters end in ``_total``, ``_ratio`` gauges stay in 0..1,
    no ``_created`` series, has help text, and carries no unbounded label (sample/request ids,
    prompts, step or version numbers as labels; ``asyncrl_build_info{version}`` excepted).
    Families whose name starts with one of ``exempt_prefixes`` (SGLang's engine metrics) are
    skipped.
    """
    from prometheus_client.parser import text_string_to_metric_families

    problems: list[str] = []
    for fam in text_string_to_metric_families(text):
        name = fam.name
        if name.startswith(exempt_prefixes):
            continue
        full = name + "_total" if fam.type == "counter" else name
        if not name.startswith("asyncrl_"):
            problems.append(f"{full}: name must start with asyncrl_")
        if ":" in name or not _NAME.match(name):
            problems.append(f"{full}: snake_case [a-z0-9_] only, no colons (colons are for recording rules)")
        if _BAD_UNIT.search(name):
            problems.append(f"{full}: use base units (_seconds, _bytes, _ratio 0-1), not {_BAD_UNIT.search(name).group(1)}")
        if not fam.documentation:
            problems.append(f"{full}: no help text")
        if fam.type == "counter" and name.endswith("_total"):
            problems.append(f"{full}: counter name doubled _total")
        if fam.type != "counter" and name.endswith("_total"):
            problems.append(f"{full}: only counters end in _total (type {fam.type})")
        for s in fam.samples:
            if s.name.endswith("_created"):
                problems.append(f"{s.name}: _created series must be disabled")
            bad = sorted(set(s.labels) & _BAD_LABELS - ({"version"} if name == "asyncrl_build_info" else set()))
            if bad:
                problems.append(f"{full}: high-cardinality label(s) {bad}")
            if name.endswith("_ratio") and not 0.0 <= s.value <= 1.0:
                problems.append(f"{s.name}: ratio {s.value} outside 0..1")
    return sorted(set(problems))
