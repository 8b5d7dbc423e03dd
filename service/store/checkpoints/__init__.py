"""Checkpoints: rows, uploads, retention, init_from and the byte stores."""
