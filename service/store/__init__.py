"""The only package that touches the database: engine and session scope, tables, and the
functions that read and change them."""
