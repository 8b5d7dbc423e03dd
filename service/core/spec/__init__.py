"""The job spec: its models, its text forms, task configs, overrides and error wording."""
