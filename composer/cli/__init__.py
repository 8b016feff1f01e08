"""``kvc``: validate, draw, export and run KV Composer pipelines.

Everything here stays importable without torch or vLLM: the commands that need
vLLM (``validate --deep``, ``serve``, ``demo``) import it inside the command.
User mistakes end with a located message and exit code 2, never a traceback.

:mod:`~composer.cli.entry` owns the entry point (``main``: parse, run, turn errors
into exit codes), handed on here; the parser is :mod:`composer.cli.parser`'s, the commands live by
concept in :mod:`~composer.cli.validating` (validate, schema, export),
:mod:`~composer.cli.showing` (graph, plugins), :mod:`~composer.cli.running`
(serve, demo, top) and :mod:`~composer.cli.measuring` (simulate, bench).
"""

from composer.cli.entry import main

__all__ = ["main"]
