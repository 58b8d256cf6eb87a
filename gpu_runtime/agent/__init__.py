"""The host agent: one long-lived process per runtime host (`python -m gpu_runtime.agent`).

* `channel` — host-queue consumer (kombu) and control-queue report sender (Celery);
* `fs_transport` — the `filesystem://` transport of every process (atomic message files);
* `serving` — the host's one engine per base model, with the LoRA runtime serving adapters;
* `runtime` — `HostRuntime`, the engine-loop driver owning `HostLoop`, jobs and commands (the
  `gpu_runtime.server` app serves inference over the same `EngineLoop`);
* `training` — the jobs placed here: trainers on the loop, progress, checkpoints, outcomes;
* `predictor` — the latency predictor artifact and the harvest estimate placement uses;
* `reporting` — heartbeat snapshot (with the serving figures the gateway routes by) and
  interval metrics;
* `jobs`, `adapters`, `checkpoint_models` — jobs from placements, checkpoints and adapters
  through storage, checkpoints served by name on demand;
* `host_auth` — what the server accepts: the gateway's grants, tenants' keys only when allowed;
* `auth` — tenants' keys checked against the control plane (TTL cache);
* `config`, `cli` — settings and the process entry point.
No Django import anywhere here.
"""
