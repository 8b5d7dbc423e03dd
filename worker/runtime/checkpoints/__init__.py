"""Checkpoints inside the ranks: snapshot, write, upload, fetch, and a command job's followed
checkpoint files (watched, saved, put back)."""
