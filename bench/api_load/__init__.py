"""`python -m bench.api_load`: the tenant API under concurrent clients (see `__main__`)."""
