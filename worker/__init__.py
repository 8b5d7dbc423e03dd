"""The worker: claims jobs through the control plane, launches each attempt (locally with
torchrun, or on Slurm), watches it and reports how it ended; ``runtime`` runs inside the ranks."""
