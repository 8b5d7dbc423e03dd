"""Who calls: API tokens."""
