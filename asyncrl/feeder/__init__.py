"""The prompt feeder role (``python -m asyncrl.feeder``): keeps R prompt groups waiting in the buffer.

:mod:`asyncrl.feeder.feeder` is the role; :mod:`asyncrl.feeder.prompt_filter` (AReaL's pass-rate
filter) and :mod:`asyncrl.feeder.selective_rollout` (GRESO's pre-rollout skip) are the two rules
that decide which train prompts it feeds.
"""
