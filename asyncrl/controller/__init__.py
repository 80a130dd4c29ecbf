"""Single-machine orchestration: ``asyncrl train`` and the processes it supervises.

The controller (:mod:`asyncrl.controller.controller`) starts Redis, the feeder, the rollout
servers and the trainer as supervised processes (:mod:`asyncrl.controller.supervisor`,
:mod:`asyncrl.controller.roles`), splits the machine's cores between them
(:mod:`asyncrl.controller.resources`), watches the run (:mod:`asyncrl.controller.run_watch`,
:mod:`asyncrl.controller.progress`) and runs the periodic held-out evaluation
(:mod:`asyncrl.controller.controller_eval`). Its errors are in :mod:`asyncrl.controller.errors`.
"""
