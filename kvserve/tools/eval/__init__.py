"""Evaluation: synthetic long-context tasks built from text that ships with Python."""
