"""The catalog: `nanwatch rules` prints it, docs/rules.md is generated from it and must not
go stale."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from nanwatch import cli
from nanwatch.rules import REGISTRY
from nanwatch.rules.base import RuleContext, rule
from nanwatch.rules.catalog import catalog_markdown, catalog_table

DOCS = Path(__file__).resolve().parent.parent / "docs" / "rules.md"
REGENERATE = "python -m nanwatch.rules.catalog > docs/rules.md"


@pytest.fixture
def user_rule() -> Iterator[str]:
    @rule("NW990", title="My [own] rule", severity="info", summary="A user's rule.")
    def mine(ctx: RuleContext) -> None:
        return None

    try:
        yield "NW990"
    finally:
        del REGISTRY["NW990"]


def test_docs_rules_md_is_generated_from_the_registry() -> None:
    assert DOCS.exists(), f"docs/rules.md is missing: run `{REGENERATE}`"
    assert DOCS.read_text(encoding="utf-8") == catalog_markdown(), (
        f"docs/rules.md is stale: run `{REGENERATE}`"
    )


def test_markdown_lists_every_builtin_rule_with_severity_and_early_flag() -> None:
    md = catalog_markdown()
    for r in REGISTRY.values():
        if not r.builtin:
            continue
        row = next(line for line in md.splitlines() if line.startswith(f"| {r.code} |"))
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[2] == r.severity
        assert cells[3] == ("yes" if r.early else "")
    assert "ignore=" in md and "NW9" in md  # how to silence, and where user codes go


def test_user_rules_show_in_the_terminal_but_not_in_the_docs(user_rule: str) -> None:
    assert f"| {user_rule} |" not in catalog_markdown()
    text = _render(catalog_table())
    assert user_rule in text and "My [own] rule" in text and "(user)" in text


def _render(renderable: object, width: int = 200) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(renderable)
    return buf.getvalue()


def test_table_has_every_code_title_and_the_early_column() -> None:
    text = _render(catalog_table())
    for r in REGISTRY.values():
        assert r.code in text
    assert "Early" in text and "Severity" in text
    row = next(line for line in text.splitlines() if "NW102" in line)
    assert "warning" in row and "yes" in row


def test_nanwatch_rules_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["rules", "--markdown"]) == 0
    assert capsys.readouterr().out == catalog_markdown()
    assert cli.main(["rules"]) == 0
    out = capsys.readouterr().out
    assert "NW101" in out and "NW402" in out


def test_catalog_module_entry_point_writes_the_markdown() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "nanwatch.rules.catalog"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out == catalog_markdown()
