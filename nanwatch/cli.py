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

    run = sub.add_parser(
        "run",
        help="run a training script unchanged, with every module watched",
        description="Run SCRIPT as __main__ with its own ARGS; every nn.Module it calls is "
        "watched through global module hooks, and loss and embedding inputs are guarded. On "
        "an anomaly or a crash a report is written; the script's exit code and exceptions "
        "are kept.",
    )
    run.add_argument("--mode", choices=("sentinel", "watch", "forensic"), default="watch")
    run.add_argument(
        "--on-anomaly",
        choices=("raise", "warn", "record"),
        default="raise",
        help="raise: stop the script at the first anomaly (default); warn: warn once and go "
        "on; record: go on silently. A report is written in every case.",
    )
    run.add_argument("--report-dir", default="nanwatch-reports", metavar="DIR")
    run.add_argument("--sample-every", type=int, default=1, metavar="N")
    run.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="PATTERN",
        help="module-path pattern whose non-finite values are intended (repeat)",
    )
    run.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="CODE",
        help="diagnosis code to silence (repeat)",
    )
    run.add_argument(
        "--no-guards", action="store_true", help="do not check loss and embedding inputs"
    )
    run.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    run.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script"
    )

    report = sub.add_parser(
        "report",
        help="re-render a saved report (JSON); --html writes a page to share",
        description="Re-render a report saved as JSON, on any machine: no model needed.",
    )
    report.add_argument("file", metavar="FILE.json")
    report.add_argument("--html", metavar="OUT", help="also write the report as an HTML page")

    rules = sub.add_parser("rules", help="print the catalog of diagnoses, with their codes")
    rules.add_argument("--markdown", action="store_true", help="print the catalog as Markdown")
    return p


def _console(*, stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(highlight=False, stderr=stderr)


def _cmd_demo(args: argparse.Namespace) -> int:
    from rich.table import Table

    from nanwatch import scenarios
    from nanwatch.render import demo_summary

    console = _console()
    if args.list:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        for s in scenarios.all_scenarios():
            grid.add_row(s.name, s.title)
        console.print(grid)
        return 0
    chosen = [scenarios.get(n) for n in args.names] if args.names else scenarios.all_scenarios()
    differ: list[str] = []
    seconds = 0.0
    for s in chosen:
        options: dict[str, Any] = {}
        if args.report_dir:
            options.update(report_dir=args.report_dir)
        outcome = scenarios.run(s, **options)
        seconds += outcome.seconds
        if args.report_dir and outcome.watcher is not None:
            outcome.watcher.report.save_all(args.report_dir, stem=s.name)
        console.print(demo_summary(outcome))
        if outcome.mismatches():
            differ.append(s.name)
    n = len(chosen)
    done = f"{n - len(differ)}/{n} scenario{'s' if n != 1 else ''} diagnosed as expected"
    console.print(
        f"{'✗' if differ else '✓'} {done} ({seconds:.1f} s)",
        style="bold red" if differ else "bold green",
        markup=False,
    )
    if differ:
        console.print(f"  not as expected: {', '.join(differ)}", markup=False)
    if args.report_dir:
        console.print(f"  full reports (JSON and HTML) in {args.report_dir}", markup=False)
    else:
        console.print("  full reports: nanwatch demo --report-dir DIR", style="dim", markup=False)
    return 1 if differ else 0


def _cmd_report(args: argparse.Namespace) -> int:
    from nanwatch.render import render_report_file

    return render_report_file(args.file, _console(), html_out=args.html)


def _cmd_rules(args: argparse.Namespace) -> int:
    from nanwatch.rules.catalog import catalog_markdown, catalog_table

    if args.markdown:
        sys.stdout.write(catalog_markdown())
        return 0
    _console().print(catalog_table())
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import os
    import runpy

    script = args.script
    if not os.path.isfile(script):
        print(f"nanwatch: error: no such script: {script!r}", file=sys.stderr)
        return 2
    import nanwatch

    try:
        nw = nanwatch.watch_all(
            mode=args.mode,
            on_anomaly=args.on_anomaly,
            report_dir=args.report_dir,
            sample_every=args.sample_every,
            allow=tuple(args.allow),
            ignore=tuple(args.ignore),
            guards=not args.no_guards,
        )
    except nanwatch.ConfigError as exc:  # named by its flag, not its Python keyword
        flag = "--" + exc.name.replace("_", "-")
        print(f"nanwatch: error: {str(exc).replace(f'`{exc.name}`', flag)}", file=sys.stderr)
        return 2
    saved_argv, saved_path0 = sys.argv, sys.path[0]
    sys.argv = [script, *args.args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code: int = 0
    crashed = False
    from nanwatch import _frames

    try:
        # the frames that run the script (the console script, runpy) are never its lines
        with _frames.launched_here(), nw:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # the script's own exit: keep its code
        code = _exit_code(exc)
    except BaseException:
        crashed = True  # the post-mortem was written on the way out; the exception goes on
        raise
    finally:
        sys.argv = saved_argv
        sys.path[0] = saved_path0
        if not crashed and nw.first_anomaly is not None:
            _end_of_run_report(nw, script)
    return code


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _end_of_run_report(nw: Any, script: str) -> None:
    """The script ended with anomalies it was told to record or warn about: write the
    report and say where it is. In a distributed run (world size > 1) each rank writes its
    own: ``<script>-rank<r>.json``."""
    import os

    from nanwatch.render import print_summary

    stem = os.path.splitext(os.path.basename(script))[0]
    try:
        report = nw.report
        env = report.environment
        if env.rank is not None and (env.world_size or 0) > 1:
            stem = f"{stem}-rank{env.rank}"
        paths = report.save_all(nw.config.report_dir, stem=stem)
    except Exception as err:  # the script ended as it chose: its exit code stays its own
        print(
            f"nanwatch: could not write the report to {str(nw.config.report_dir)!r} "
            f"({type(err).__name__}: {err}); give --report-dir a writable directory.",
            file=sys.stderr,
        )
        return
    print_summary(report, paths, console=_console(stderr=True))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "run":  # the script's own exceptions must come out unchanged
        return _cmd_run(args)
    handlers = {"demo": _cmd_demo, "report": _cmd_report, "rules": _cmd_rules}
    from nanwatch.errors import ConfigError, ReportFormatError

    try:
        return handlers[args.command](args)
    except (ConfigError, ReportFormatError, FileNotFoundError) as exc:
        print(f"nanwatch: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an --html path that cannot be written
        print(f"nanwatch: error: cannot write {exc.filename!r}: {exc.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
