"""Sweeps in the database: submit, progress, the trials view, curves."""
