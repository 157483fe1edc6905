"""``python -m nanwatch``: the same as the ``nanwatch`` command."""

from nanwatch.cli import main

raise SystemExit(main())
