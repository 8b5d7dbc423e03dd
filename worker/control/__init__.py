"""The worker's side of the control plane: the records interface the loop holds its jobs
through (``records``), the lease fence that stops ranks before a lease it could not renew can
lapse (``fences``), and a clean shutdown's handling of held jobs (``shutdown``)."""
