"""The one-line summary of a post-mortem (``→ NW112 ...; fix: ...``) shows the fix's
line that changes the user's code, not a helper constant it defines first."""

from __future__ import annotations

from nanwatch.render import key_line


def test_a_helper_constant_is_not_the_line_shown() -> None:
    fix = (
        "eps = torch.finfo(torch.float32).eps\n"
        "y = torch.where(x > 0, x.clamp_min(eps) ** 0.75, 0)   # was x ** 0.75"
    )
    assert key_line(fix) == "y = torch.where(x > 0, x.clamp_min(eps) ** 0.75, 0)   # was x ** 0.75"


def test_the_rewrite_of_the_users_line_is_shown_first() -> None:
    fix = (
        "# adapt: your loop\n"
        "norm = x.norm()\n"
        "loss = a / norm.clamp_min(1e-6)  # was: loss = a / norm"
    )
    assert key_line(fix).startswith("loss = a / norm.clamp_min(1e-6)")


def test_a_comment_only_fix_shows_its_first_line() -> None:
    assert key_line("# keep 0 out of the log\n# or use log1p") == "# keep 0 out of the log"
    assert key_line("") == ""
