"""Code that runs inside every rank: dist init, trainer loop, metrics sink, checkpoints, signals."""
