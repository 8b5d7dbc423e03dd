"""Workers in the database: registration, leases and heartbeats, pruning."""
