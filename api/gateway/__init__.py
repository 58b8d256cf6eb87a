"""The inference gateway: OpenAI's `/v1/completions` and `/v1/chat/completions` on the control
plane's base URL, routed to the runtime hosts (see `app.Gateway`). `GET /v1/models` stays in the
tenant API."""
