"""``kvc bench``: replay a trace against real servers, one per configuration, and report.

:mod:`.spec` says what a run is asked to do, :mod:`.run` drives a whole run (or
:mod:`.fleet`, engines behind vLLM's router), :mod:`.servers` starts and stops
each server, :mod:`.replay` turns a trace into requests and sends them,
:mod:`.report` reads the engines' counters and prints the results.
"""
