"""``kvc bench``: replay a trace against real servers, one per configuration, and report.

:mod:`.run` drives a whole run, :mod:`.servers` starts and stops each server,
:mod:`.replay` turns a trace into requests and sends them, :mod:`.report` prints the results.
"""
