"""The training loop, the TrainContext entrypoints get, and the rank session (metrics,
checkpoints, stop vote) that it and the ``ddpq`` library both run on."""
