"""A command job's rank side: bring the job's workspace onto this host (``workspace``), then
start the user's script as torchrun would and turn its end into the rank's (``run``)."""
