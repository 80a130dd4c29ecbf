"""Small role processes (feeder, rollout worker, trainer) used by the buffer crash tests."""
