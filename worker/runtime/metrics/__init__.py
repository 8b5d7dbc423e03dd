"""Rank 0's metric sink: buffer, backlog, background writer."""
