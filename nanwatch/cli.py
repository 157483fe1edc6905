"""The ``nanwatch`` command. Heavy imports (torch) are deferred so ``--help`` is instant."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

_DESCRIPTION = "Find where and why a PyTorch model's numbers went wrong."


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nanwatch")
    except PackageNotFoundError:
        return "0+unknown"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanwatch", description=_DESCRIPTION)
    p.add_argument("--version", action="version", version=f"nanwatch {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="run the built-in gallery of real failures and show the diagnoses",
        description="Run the built-in gallery of real failures, each diagnosed by nanwatch.",
    )
    demo.add_argument("names", nargs="*", metavar="NAME", help="scenarios to run (default: all)")
    demo.add_argument("--list", action="store_true", help="list the scenarios and exit")
    demo.add_argument("--report-dir", metavar="DIR", help="write each scenario's full report here")

    rules = sub.add_parser("rules", help="print the catalog of diagnoses, with their codes")
    rules.add_argument("--markdown", action="store_true", help="print the catalog as Markdown")
    return p


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False)


def _cmd_demo(args: argparse.Namespace) -> int:
    from nanwatch import scenarios
    from nanwatch.render import demo_summary

    console = _console()
    if args.list:
        for s in scenarios.all_scenarios():
            console.print(f"[bold]{s.name:28s}[/bold] {s.title}")
        return 0
    chosen = [scenarios.get(n) for n in args.names] if args.names else scenarios.all_scenarios()
    failures = 0
    for s in chosen:
        options: dict[str, Any] = {}
        if args.report_dir:
            options.update(report_dir=args.report_dir)
        outcome = scenarios.run(s, **options)
        if args.report_dir and outcome.watcher is not None:
            outcome.watcher.report.save_all(args.report_dir, stem=s.name)
        console.print(demo_summary(outcome))
        failures += bool(outcome.mismatches())
    return 1 if failures else 0


def _cmd_rules(args: argparse.Namespace) -> int:
    from nanwatch.rules.catalog import catalog_markdown, catalog_table

    if args.markdown:
        sys.stdout.write(catalog_markdown())
        return 0
    _console().print(catalog_table())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    handlers = {"demo": _cmd_demo, "rules": _cmd_rules}
    from nanwatch.errors import NanwatchError

    try:
        return handlers[args.command](args)
    except NanwatchError as exc:
        print(f"nanwatch: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
