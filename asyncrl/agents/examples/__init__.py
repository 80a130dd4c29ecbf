"""Example agent programs for the built-in ``openai_harness`` workflow (docs/agents.md)."""
