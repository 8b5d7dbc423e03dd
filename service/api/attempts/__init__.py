"""The ranks' API (attempt token only): metrics, progress, checkpoints, notes, workspace."""
