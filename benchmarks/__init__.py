"""Benchmarks: side-by-side runs that print ratios against a baseline of the same run.

Never run as tests; ``tests/test_benchmarks_cli.py`` only checks that each
script imports and answers ``--help``. See ``docs/benchmarks.md``.
"""
