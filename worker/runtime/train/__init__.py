"""The training loop and the TrainContext entrypoints get."""
