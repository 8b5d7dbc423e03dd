"""The client side of workspaces: pack a working directory (``pack``), turn what a user typed
after ``ddpq run`` into a command and resources (``command``), upload what the API lacks
(``upload``). No torch, no sqlalchemy: the CLI and ``DdpqClient`` import it."""
