"""The sweep resource's routes."""
