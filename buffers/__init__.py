"""The Redis replay buffer: partial samples, token-budget regeneration, staleness, crash safety."""
