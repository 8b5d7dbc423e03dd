"""Where checkpoint bytes live: the store interface and its backends."""
