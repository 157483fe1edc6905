"""The ``nanwatch`` command. Heavy imports (torch) are deferred so ``--help`` is instant."""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator, Sequence
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
        "watched through global module hooks, and loss and embedding inputs are guarded; "
        "while a watcher of the script's own (nanwatch.watch(model)) is attached, it alone "
        "watches and reports, with the script's options. On an anomaly or a crash a report "
        "is written; the script's exit code and exceptions are kept.",
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
    run.add_argument(
        "-m",
        dest="module",
        metavar="MODULE",
        help="run MODULE as __main__, as python -m does (a package's module with relative "
        "imports: -m pkg.train); the arguments after it are the script's",
    )
    run.add_argument("script", nargs="?", metavar="SCRIPT", help="the Python script to run")
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


def _split_run(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """``nanwatch run``'s own arguments, up to and including SCRIPT (or ``-m MODULE``), and
    the script's arguments after it, exactly as given: argparse's REMAINDER drops a leading
    ``--`` that ``python train.py -- a`` keeps."""
    if not argv or argv[0] != "run":
        return argv, []
    run = next(
        a.choices["run"] for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    )
    takes_value = {
        flag: action.nargs != 0 for action in run._actions for flag in action.option_strings
    }
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "--":  # what follows is SCRIPT
            return argv[: i + 2], argv[i + 2 :]
        if token.startswith("-m"):
            end = i + 2 if token == "-m" else i + 1  # -m pkg.train or -mpkg.train
            return argv[:end], argv[end:]
        if token.startswith("-") and token != "-":
            name = token.split("=", 1)[0]
            known = [f for f in takes_value if f == name] or [
                f for f in takes_value if f.startswith(name) and name.startswith("--")
            ]
            if "=" not in token and len(known) == 1 and takes_value[known[0]]:
                i += 1  # its value
            i += 1
            continue
        return argv[: i + 1], argv[i + 1 :]  # SCRIPT
    return argv, []


def _run_script(path: str) -> None:
    """Run the file ``path`` as ``__main__`` as ``python path`` does: ``__file__`` absolute
    (a script that changes directory, Hydra-style, still finds files next to it),
    ``sys.argv[0]`` as typed. A directory or zip file with a ``__main__.py`` goes to
    :func:`runpy.run_path`, as python does."""
    import builtins
    import importlib.machinery
    import os
    import runpy
    import types
    import zipfile

    full = os.path.abspath(path)
    if not os.path.isfile(full) or full.endswith((".pyc", ".pyo")) or zipfile.is_zipfile(full):
        runpy.run_path(path, run_name="__main__")
        return
    with open(full, "rb") as f:
        source = f.read()
    code = compile(source, full, "exec", dont_inherit=True)  # not this file's __future__
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=full,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", full),
        __package__=None,
        __spec__=None,
        __builtins__=builtins,
    )
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is None:
            sys.modules.pop("__main__", None)
        else:
            sys.modules["__main__"] = saved


def _cmd_run(args: argparse.Namespace) -> int:
    import os

    module: str | None = args.module
    script: str = args.script or ""
    if (module is None) == (args.script is None):
        what = "give a SCRIPT or -m MODULE, not both" if module else "give a SCRIPT to run"
        print(f"nanwatch: error: {what} (nanwatch run --help)", file=sys.stderr)
        return 2
    saved_argv, saved_path0 = sys.argv, sys.path[0]
    if module is not None:
        import importlib.util

        sys.path[0] = os.getcwd()  # python -m: the current directory comes first
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            sys.path[0] = saved_path0
            print(f"nanwatch: error: no module named {module!r}", file=sys.stderr)
            return 2
        script = module.rsplit(".", 1)[-1] + ".py"  # names the end-of-run report
    elif not os.path.isfile(script):
        print(f"nanwatch: error: no such script: {script!r}", file=sys.stderr)
        return 2
    import nanwatch

    options: dict[str, Any] = dict(
        mode=args.mode,
        on_anomaly=args.on_anomaly,
        # the script may change directory (Hydra does): the reports go where nanwatch was
        # started, and the paths it prints stay valid
        report_dir=os.path.abspath(args.report_dir),
        sample_every=args.sample_every,
        allow=tuple(args.allow),
        ignore=tuple(args.ignore),
        guards=not args.no_guards,
    )
    try:
        nw = nanwatch.watch_all(**options)
    except nanwatch.ConfigError as exc:  # named by its flag, not its Python keyword
        flag = "--" + exc.name.replace("_", "-")
        print(f"nanwatch: error: {str(exc).replace(f'`{exc.name}`', flag)}", file=sys.stderr)
        sys.path[0] = saved_path0
        return 2
    sys.argv = [module or script, *args.args]  # run_module sets argv[0] to the module's file
    if module is None:
        sys.path[0] = os.path.dirname(os.path.abspath(script))
    code: int = 0
    crashed = False
    from nanwatch import _frames

    try:
        # the frames that run the script (the console script, runpy) are never its lines
        held: BaseException | None = None
        with _frames.launched_here(), _children_watched(options, script) as children, nw:
            try:
                if module is not None:
                    import runpy

                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    _run_script(script)
            except BaseException as exc:
                if not children.failed(exc):
                    raise
                held = exc  # a watched child's failure: its own report names the cause
        if held is not None:
            raise held
    except SystemExit as exc:  # the script's own exit: keep its code
        code = _exit_code(exc)
        from nanwatch.postmortem import interrupt_behind

        # after a Ctrl-C (Lightning exits with 1): the post-mortem was written on the way out
        crashed = interrupt_behind(exc) is not None
    except BaseException:
        crashed = True  # the post-mortem was written on the way out; the exception goes on
        raise
    finally:
        sys.argv = saved_argv
        sys.path[0] = saved_path0
        if not crashed and nw.first_anomaly is not None:
            _end_of_run_report(nw, script)
    return code


class _Children:
    """The child processes a :func:`_children_watched` block started watched."""

    def __init__(self) -> None:
        self.watched = 0

    def failed(self, exc: BaseException) -> bool:
        """Whether ``exc`` is ``torch.multiprocessing.spawn`` reporting that a watched child
        failed: that child wrote its own report; this process has nothing to add."""
        spawn = sys.modules.get("torch.multiprocessing.spawn")
        kind = getattr(spawn, "ProcessException", None)
        return bool(self.watched) and isinstance(kind, type) and isinstance(exc, kind)


@contextlib.contextmanager
def _children_watched(options: dict[str, Any], script: str) -> Iterator[_Children]:
    """While the body runs, a process it starts that runs the script's own code (an
    ``mp.spawn`` rank, a ``multiprocessing.Process`` of any start method) runs that code
    under a watcher of its own, with the same options: a spawned child re-imports the
    script without ``nanwatch run``'s hooks, and a forked one drops its parent's. Workers of
    the standard library and torch (a ``Pool``, a DataLoader worker) are left as they are."""
    from multiprocessing.process import BaseProcess

    children = _Children()
    original = BaseProcess.start
    if getattr(original, "_nanwatch_options", None) is not None:  # already in place
        yield children
        return

    @functools.wraps(original)
    def start(self: BaseProcess) -> None:
        restore = _wrap_process(self, options, script)
        children.watched += restore is not _nothing
        try:
            original(self)  # a spawned child gets the process pickled, a forked one a copy
        finally:
            restore()  # the parent's object as it was

    start._nanwatch_options = options  # type: ignore[attr-defined]
    BaseProcess.start = start  # type: ignore[method-assign]
    try:
        yield children
    finally:
        BaseProcess.start = original  # type: ignore[method-assign]


def _wrap_process(proc: Any, options: dict[str, Any], script: str) -> Callable[[], None]:
    """Make ``proc`` run its user code watched (see :func:`_children_watched`); returns what
    puts the process object back as it was, once the child is started."""
    from multiprocessing.process import BaseProcess

    state = proc.__dict__
    if type(proc).run is not BaseProcess.run:  # a subclass with its own run()
        if "run" in state or not _is_user_code(type(proc).run):
            return _nothing
        state["run"] = _Watched(options, script, functools.partial(type(proc).run, proc))
        return functools.partial(state.pop, "run", None)
    target, args = state.get("_target"), state.get("_args", ())
    if target is None:
        return _nothing
    spawn_mod = sys.modules.get("torch.multiprocessing.spawn")
    if target is getattr(spawn_mod, "_wrap", None) and args and callable(args[0]):
        # torch.multiprocessing.spawn runs _wrap(fn, rank, args, error_file): fn is the
        # script's, and _wrap sends its exception to the parent
        if not _is_user_code(args[0]):
            return _nothing
        state["_args"] = (_Watched(options, script, args[0]), *args[1:])
        return functools.partial(state.__setitem__, "_args", args)
    if not _is_user_code(target):
        return _nothing
    state["_target"] = _Watched(options, script, target)
    return functools.partial(state.__setitem__, "_target", target)


def _nothing() -> None:
    return None


def _is_user_code(fn: Any) -> bool:
    """Whether ``fn`` is defined outside the standard library, torch and nanwatch."""
    import inspect

    from nanwatch import _frames

    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object: its __call__
        call = type(fn).__call__ if callable(fn) else None
        code = getattr(getattr(call, "__func__", call), "__code__", None)
    if code is None:
        return False
    return not _frames.is_core(code.co_filename)


class _Watched:
    """A child process's work, run under ``nanwatch run``'s options. Pickled to a spawned
    child by reference to this module: the child imports nanwatch before it runs it."""

    def __init__(self, options: dict[str, Any], script: str, fn: Callable[..., Any]) -> None:
        self.options, self.script, self.fn = options, script, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        import nanwatch
        from nanwatch.report import rank_of

        nw = nanwatch.watch_all(**self.options)
        ended = False  # returned or exited: the work's own end, not a crash

        def note_rank(*_: Any) -> None:
            # the process group is made after the watcher attached, and may be destroyed
            # before the report is written: the rank is read at the first call once it is
            if rank_of(nw)[0] is not None:
                found.remove()

        found = torch.nn.modules.module.register_module_forward_pre_hook(note_rank)
        from nanwatch import _frames

        try:
            # a spawned child starts with no launcher of its own: its advice is still
            # nanwatch run's (--ignore), as in the parent
            with _frames.launched_here(), _children_watched(self.options, self.script), nw:
                result = self.fn(*args, **kwargs)
            ended = True
            return result
        except SystemExit as exc:
            from nanwatch.postmortem import interrupt_behind

            ended = interrupt_behind(exc) is None  # a Ctrl-C's exit wrote its post-mortem
            raise
        finally:
            found.remove()
            if ended and nw.first_anomaly is not None:
                import multiprocessing

                _end_of_run_report(nw, self.script, multiprocessing.current_process().name)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _end_of_run_report(nw: Any, script: str, process: str | None = None) -> None:
    """The script ended with anomalies it was told to record or warn about: write the
    report and say where it is. In a distributed run (world size > 1) each rank writes its
    own: ``<script>-rank<r>.json``; a child process of no rank, ``<script>-<process>.json``
    (``process``: its name, ``SpawnProcess-2``)."""
    import os

    from nanwatch.render import print_summary

    stem = os.path.splitext(os.path.basename(script))[0]
    try:
        report = nw.report
        env = report.environment
        if env.rank is not None and (env.world_size or 0) > 1:
            stem = f"{stem}-rank{env.rank}"
        elif process:
            stem = f"{stem}-{process}"
        paths = report.save_all(nw.config.report_dir, stem=stem)
    except Exception as err:  # the script ended as it chose: its exit code stays its own
        print(
            f"nanwatch: could not write the report to {str(nw.config.report_dir)!r} "
            f"({type(err).__name__}: {err}); give --report-dir a writable directory.",
            file=sys.stderr,
        )
        return
    print_summary(report, paths, console=_console(stderr=True))


def _is_program(caller: types.FrameType | None) -> bool:
    """Whether ``caller`` is the program's top level (the console script, ``python -m
    nanwatch``): an exception out of :func:`main` ends the process, and Python prints it."""
    return (
        caller is not None
        and caller.f_code.co_name == "<module>"
        and caller.f_globals.get("__name__") == "__main__"
    )


def _script_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` from the script's first frame on, as ``python script.py`` prints it: the
    launcher's frames (the console script, this file, runpy's) left out; ``tb`` itself when
    the exception was not raised inside the script."""
    import os

    here = os.path.normcase(os.path.abspath(__file__))
    start, t = None, tb
    while t is not None:
        if os.path.normcase(os.path.abspath(t.tb_frame.f_code.co_filename)) == here:
            start = t.tb_next  # the call into the script (exec, runpy) is the last of ours
        t = t.tb_next
    while start is not None and _is_runpy(start.tb_frame.f_code.co_filename):
        start = start.tb_next
    return start if start is not None else tb


def _is_runpy(filename: str) -> bool:
    import os
    import runpy

    return filename == "<frozen runpy>" or os.path.abspath(filename) == os.path.abspath(
        runpy.__file__
    )


def _run_as_program(args: argparse.Namespace) -> int:
    """:func:`_cmd_run` for the program's top level: the script's exception goes on
    unchanged (its exit code is Python's), and the traceback Python prints of it leaves out
    nanwatch's and runpy's frames, as ``python script.py`` would print it."""
    try:
        return _cmd_run(args)
    except SystemExit:
        raise
    except BaseException as exc:
        previous, raised = sys.excepthook, exc  # (``exc`` is unbound after the except)

        def hook(
            kind: type[BaseException], value: BaseException, tb: types.TracebackType | None
        ) -> None:
            if value is raised:
                try:
                    tb = _script_traceback(tb)
                    value.__traceback__ = tb
                except Exception:  # printing the user's exception matters more than ours
                    pass
            previous(kind, value, tb)

        sys.excepthook = hook
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    own, script_args = _split_run(parser, list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(own)
    if args.command == "run":
        args.args = list(args.args) + script_args  # after SCRIPT: the script's, unchanged
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "run":  # the script's own exceptions must come out unchanged
        if _is_program(sys._getframe(1)):
            return _run_as_program(args)
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
