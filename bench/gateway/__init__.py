"""`python -m bench.gateway`: what the inference gateway adds to a stream, and what a killed host
costs. Real processes on this machine: the control plane under uvicorn (SQLite, the filesystem
broker), a Celery worker and host agents serving the tiny model on the CPU."""
