"""Metric points as reported and stored, and which metric sums a job up."""
