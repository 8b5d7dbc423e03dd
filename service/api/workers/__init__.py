"""The workers list."""
