"""Evaluation of teacher and converted models."""
