"""``python -m bench.prefix_cache``: TTFT and requests/s with automatic prefix caching on vs off."""
