"""Servers the project starts for itself: on loopback, on free ports, health-checked, stopped."""

from composer.servers.loopback import LOOPBACK, free_port
from composer.servers.valkey import ValkeyServer, ping, valkey_server, valkey_server_binary

__all__ = ["LOOPBACK", "ValkeyServer", "free_port", "ping", "valkey_server", "valkey_server_binary"]
