"""The `ddpq` command line (Typer): ``service.cli.main`` assembles it."""
