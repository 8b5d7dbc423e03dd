"""Workers: the workers list (users), and the worker API under /workers/self (workers only)."""
