"""Example job specs (YAML) and an example user entrypoint for ddpq."""
