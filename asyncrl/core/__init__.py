"""The shared core every role builds on; it imports nothing else of the project.

The data model and its one finish-reason vocabulary (:mod:`asyncrl.core.types`), the
configuration (:mod:`asyncrl.core.config`, its sections and its command-line parsing), secrets,
ports and HTTP helpers (:mod:`asyncrl.core.net`), the weight transports the trainer and the
rollout servers meet at (:mod:`asyncrl.core.weights`), and the small process and asyncio
primitives several roles share (outage, core following, the process guard).
"""
