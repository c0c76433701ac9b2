"""Stress scenarios for Flowcast: bounded storms that check the stream's invariants.

Run them with ``python -m stress.run [--long] [--only NAME]``; see ``stress/README.md``.
"""
