"""A job's checkpoints: list and download."""
