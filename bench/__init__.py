"""Benchmarks: ``python -m bench`` (``make bench``) runs every ``bench_*.py`` module's ``main()``.

Benchmarks print what they measure next to the target; they never assert.
"""
