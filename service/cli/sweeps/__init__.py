"""The sweep resource's commands (`ddpq sweep …`) and what `ddpq sweep submit` checks and
prints before it sends anything."""
