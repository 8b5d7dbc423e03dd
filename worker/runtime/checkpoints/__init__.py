"""Checkpoints inside the ranks: snapshot, write, upload, fetch."""
