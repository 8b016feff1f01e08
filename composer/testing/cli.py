"""``kvc`` in the test's own process, so that what a test stood in (a table it
monkeypatched, an installed package it faked) applies to the command."""

from __future__ import annotations


def kvc(*args: str) -> int:
    """Run ``kvc args...`` here; its exit status (its output goes to stdout/stderr)."""
    from composer.cli import main  # (the CLI's modules, only when a test runs it)

    return main(list(args))
