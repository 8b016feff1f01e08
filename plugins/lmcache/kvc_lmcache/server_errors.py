"""What can go wrong with the server node's ``lmcache server``: one hierarchy, a name for
each thing that happened.

* :class:`ServerDidNotStart`: a started server exited while starting, was not
  healthy in time, or there is no ``lmcache`` command to start it with;
* :class:`ServerDoesNotFit`: the server (given, or about to be started) does not
  fit the engine: its chunk size, its transfer mode, its L1 in this machine's memory;
* :class:`ServerUnreachable`: a given server does not answer over its HTTP frontend;
* :class:`ServerReleased`: a started server is not started again, since the
  process that started it released it (its engine is stopping);
* :class:`ServerDown`: the server died or stopped answering while the engine
  runs. Also :class:`composer.Unavailable`: the node's store is away, no fault
  (the chain counts it and keeps the node on).

A start-up error (the first three) fails the engine's start; after a restart
that fails the node tries again later.
"""

from __future__ import annotations

from composer import Unavailable


class LMCacheServerError(RuntimeError):
    """Something went wrong with the node's LMCache server (a subclass says what)."""


class ServerDidNotStart(LMCacheServerError):
    """A started server exited while starting or was not healthy in time, or the
    ``lmcache`` command is missing."""


class ServerDoesNotFit(LMCacheServerError):
    """The server does not fit the engine: chunk size, transfer mode, or its L1 in
    the memory available."""


class ServerUnreachable(LMCacheServerError):
    """A given server does not answer its health check, or its config cannot be read."""


class ServerReleased(LMCacheServerError):
    """A started server is not started again: the process that started it released it
    (the engine is stopping)."""


class ServerDown(LMCacheServerError, Unavailable):
    """The LMCache server died (or stopped answering) while the engine runs: the
    node's store is away (no fault; the chain counts it and keeps the node on)."""
