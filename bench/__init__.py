"""Benchmarks, run from the checkout's root as ``python -m bench.NAME`` (they share the tests'
fleet through ``tests.support``)."""
