"""Metric points in the database: ingest, queries, history across attempts."""
