"""The vocabulary every ddpq process shares (settings, errors, states, spec, …); imports
nothing else of ours."""
