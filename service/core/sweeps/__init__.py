"""Sweeps' pure parts: the sweep spec, trial identity and the ASHA decision."""
