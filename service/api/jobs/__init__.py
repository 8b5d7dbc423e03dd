"""The job resource's routes: submit, list, get, cancel, events, logs, goodput."""
