"""Servers the project starts for itself: on loopback, on free ports, health-checked, stopped;
and the child processes they run as (:mod:`composer.servers.process`)."""

from composer.servers.loopback import LOOPBACK, free_port
from composer.servers.process import (
    alive,
    cpu_seconds,
    group_alive,
    kill_group,
    kill_process,
    spawn,
    stop_group,
    stop_process,
    tail,
)
from composer.servers.valkey import ValkeyServer, ping, valkey_server, valkey_server_binary

__all__ = [
    "LOOPBACK",
    "ValkeyServer",
    "alive",
    "cpu_seconds",
    "free_port",
    "group_alive",
    "kill_group",
    "kill_process",
    "ping",
    "spawn",
    "stop_group",
    "stop_process",
    "tail",
    "valkey_server",
    "valkey_server_binary",
]
