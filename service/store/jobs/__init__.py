"""Jobs in the database: submit, list, transitions, claims, the queue and notes."""
