"""Attempts in the database: tokens, timelines and the goodput ledger."""
