"""The catalog of diagnoses: ``nanwatch rules`` prints it, ``docs/rules.md`` is generated
from it (``python -m nanwatch.rules.catalog > docs/rules.md``; a test fails when the file
is stale).

Example:
    >>> md = catalog_markdown()
    >>> "| NW101 |" in md and "ignore=" in md
    True
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.markup import escape
from rich.table import Table

from nanwatch.rules.base import Rule, catalog

#: code ranges, in catalog order: (first code, last code, heading)
RANGES: tuple[tuple[int, int, str], ...] = (
    (100, 199, "Numerics: overflow, headroom, math outside its domain, empty reductions"),
    (200, 299, "Losses: saturation, activation/loss pairing, ignore_index logits"),
    (300, 399, "Gradients, weights, optimizer and loss scaler"),
    (400, 499, "Data, masking, autograd, runtime"),
    (500, 599, "Guards: loss inputs stopped before the kernel ran"),
)

_HEADER = """\
# Diagnoses

<!-- Generated from the rule registry by `python -m nanwatch.rules.catalog > docs/rules.md`.
     Do not edit by hand: tests/test_rules_catalog.py fails when this file is stale. -->

Every diagnosis nanwatch reports carries a stable code, like a linter's: a code never
changes meaning and is never reused. `nanwatch rules` prints this catalog in the terminal.

- **Severity**: `error` diagnoses are what `watch(..., on_anomaly=...)` acts on; `warning`
  and `info` are reported only. A diagnosis may carry a higher severity than its rule's
  usual one when the evidence is strong (NW206 becomes an error once the overflow happened).
- **Early**: the rule can fire before any NaN or inf exists (a warning while there is still
  time to act).
- **Silence** a code with `nanwatch.watch(model, criterion, ignore=["NW102"])`.
- Thresholds (`nanwatch.Thresholds`) are factors and counts; every dtype limit comes from
  `torch.finfo` of the tensor at hand (float16: largest value 65504, exp overflows above
  log(65504) = 11.09; bfloat16 and float32: 88.72).
"""

_FOOTER = """\
## Your own rules

Rules are plain functions of the step's records; user rules use the same decorator as
the built-in ones. Codes from NW900 up are free for you. A rule that raises is reported
once and disabled; training goes on.

```python
import nanwatch
from nanwatch.rules import rule

@rule("NW901", title="Loss above 1e4", severity="warning",
      summary="The loss is larger than 1e4.", early=True)
def huge_loss(ctx):
    if ctx.trace.loss is not None and ctx.trace.loss > 1e4:
        yield ctx.diagnosis(evidence=[f"loss = {ctx.trace.loss:.4g}"],
                            explanation="The loss exploded.",
                            fix="optimizer = torch.optim.AdamW(params, lr=1e-4)")
```

`nanwatch.rules.testing.TraceBuilder` builds step traces by hand to test a rule without a
model.
"""


def _number(r: Rule) -> int:
    return int(r.code[2:])


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def catalog_markdown(rules: Sequence[Rule] | None = None) -> str:
    """The catalog as Markdown (the content of ``docs/rules.md``): the rules that ship
    with nanwatch, grouped by code range, with severity, early flag and summary."""
    chosen = [r for r in (catalog() if rules is None else rules) if rules is not None or r.builtin]
    lines = [_HEADER]
    placed: set[str] = set()
    groups: list[tuple[str, list[Rule]]] = []
    for lo, hi, heading in RANGES:
        members = [r for r in chosen if lo <= _number(r) <= hi]
        placed.update(r.code for r in members)
        groups.append((f"{heading} (NW{lo // 100}xx)", members))
    rest = [r for r in chosen if r.code not in placed]
    if rest:
        groups.append(("Other rules", rest))
    for heading, members in groups:
        if not members:
            continue
        lines.append(f"## {heading}\n")
        lines.append("| Code | Title | Severity | Early | Summary |")
        lines.append("|------|-------|----------|-------|---------|")
        for r in members:
            early = "yes" if r.early else ""
            lines.append(
                f"| {r.code} | {_cell(r.title)} | {r.severity} | {early} | {_cell(r.summary)} |"
            )
        lines.append("")
    lines.append(_FOOTER)
    return "\n".join(lines)


_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def catalog_table(rules: Sequence[Rule] | None = None) -> Table:
    """The catalog as a rich table: code, title, severity, early-warning flag, one line.
    Your own registered rules are listed too (family ``user``).

    >>> from rich.console import Console
    >>> Console(width=120).print(catalog_table())  # doctest: +SKIP
    """
    table = Table(
        title="nanwatch diagnoses",
        caption='silence one with nanwatch.watch(..., ignore=["NW102"]); early: can fire '
        "before any NaN exists",
        show_lines=False,
        expand=False,
    )
    table.add_column("Code", no_wrap=True, style="bold")
    table.add_column("Title")
    table.add_column("Severity", no_wrap=True)
    table.add_column("Early", no_wrap=True, justify="center")
    table.add_column("Summary")
    for r in catalog() if rules is None else rules:
        title = escape(r.title) + ("" if r.builtin else f" [dim]({escape(r.family)})[/dim]")
        table.add_row(
            r.code,
            title,
            f"[{_STYLE.get(r.severity, '')}]{r.severity}[/]",
            "yes" if r.early else "",
            escape(r.summary),
        )
    return table


def main() -> int:
    sys.stdout.write(catalog_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
