"""A command job's rank side: bring the job's workspace onto this host (``workspace``), start
the user's script as torchrun would and turn its end into the rank's (``run``), follow the files
it writes (``follow``, ``tensorboard``), and the ``ddpq`` library's session inside it
(``session``)."""
