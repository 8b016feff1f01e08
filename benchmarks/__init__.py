"""Benchmarks: ``python -m benchmarks`` (``make bench``) runs every benchmark's ``main()``.

A benchmark is a module of this folder or of a plugin's ``benchmarks/`` folder
with a ``main()``; the other modules here are what the benchmarks load into vLLM.
Benchmarks print what they measure next to the target; they never assert.
"""
