"""Serving: run-time layer conversion under memory pressure (levels, policies, sampling, engine)."""
