"""Shared setup for the pure-core tests.

pytest's default (prepend) import mode puts this directory on sys.path when it loads this file,
which is what lets the test modules below import the shared helpers in `core_helpers.py`.
"""
