"""What one owner may run and store: the Unix user each owner's ranks run as
(``rank_users``) and the quotas on what one job or owner may store or send (``quotas``)."""
