"""Rollout servers: the embedded torch engine (SGLang HTTP API), the SGLang backend and the rollout worker."""
