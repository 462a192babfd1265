"""Two runs' figures side by side, as the serving benchmarks print them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

FIGURES = {
    "hit_rate": ("prefix-hit rate", "{:.1%}", 1.0),
    "ttft_p50": ("TTFT p50 (s)", "{:.2f}", 1.0),
    "ttft_p99": ("TTFT p99 (s)", "{:.2f}", 1.0),
    "itl_p50": ("ITL p50 (ms)", "{:.1f}", 1000.0),
    "tokens_per_s": ("output tokens/s", "{:.1f}", 1.0),
    "seconds": ("seconds for all", "{:.1f}", 1.0),
}
"""How a serving run's figure (by key) is shown: its label, its format, and
the factor its value is multiplied by first (inter-token gaps are measured
in seconds and shown in ms)."""


def comparison_rows(
    headers: tuple[str, str, str],
    a: Mapping[str, float],
    b: Mapping[str, float],
    keys: Sequence[str],
) -> list[str]:
    """The lines of a Markdown table comparing run a with run b: a header
    (metric, then `headers`: a's name, b's name, the ratio's name), then a
    row for each key of FIGURES in `keys`: a[key] and b[key] as FIGURES shows
    them and a[key] / b[key] (nan where b's is 0). The caller appends rows
    of its own (counts) after."""
    lines = [f"| metric | {' | '.join(headers)} |", "|---|---|---|---|"]
    for key in keys:
        label, fmt, factor = FIGURES[key]
        x, y = a[key] * factor, b[key] * factor
        ratio = x / y if y else float("nan")
        lines.append(f"| {label} | {fmt.format(x)} | {fmt.format(y)} | {ratio:.2f}x |")
    return lines
