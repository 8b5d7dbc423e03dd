"""The dashboard: HTML pages, their templates and static scripts, served by the API's app."""
