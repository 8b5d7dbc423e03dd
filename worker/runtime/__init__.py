"""Code that runs inside every rank: dist init, trainer loop, the rank's session (metrics sink,
checkpoints, stop vote), signals."""
