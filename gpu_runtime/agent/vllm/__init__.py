"""An `--engine vllm` host: a vLLM OpenAI server supervised by the agent, reporting through the
agent's heartbeat and metrics builders (README.md in this folder)."""
