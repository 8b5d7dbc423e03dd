"""The local launcher: torchrun on the worker's own host."""
