"""The host agent: one long-lived process per runtime host (`python -m gpu_runtime.agent`).

* `protocol` — the message formats between control plane and agents;
* `channel` — host-queue consumer (kombu) and control-queue report sender (Celery);
* `runtime` — the engine-loop thread owning `HostLoop`, jobs and adapter engines;
* `jobs`, `adapters` — jobs from placements, checkpoints and adapters through storage;
* `auth`, `http` — tenants' keys (TTL cache) and the OpenAI-compatible server;
* `config`, `cli` — settings and the process entry point.
No Django import anywhere here.
"""
