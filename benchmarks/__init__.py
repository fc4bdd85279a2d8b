"""Benchmarks: side-by-side runs that print ratios against a baseline of the same run.

Never timed in tests: ``tests/test_benchmarks_cli.py`` runs each CPU script once at its
smallest size (``--smoke``, or the smallest values of its own flags) and checks the shape of
what it prints and writes; the GPU-only scripts answer ``--help`` there. See
``docs/benchmarks.md``.
"""
