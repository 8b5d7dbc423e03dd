"""A job's metric points."""
