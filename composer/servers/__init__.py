"""Servers the project starts for itself: on loopback, on free ports, health-checked, stopped."""
