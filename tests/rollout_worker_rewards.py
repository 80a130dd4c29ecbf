"""Reward functions used by tests/test_rollout_worker.py (imported by name, as ``data.reward`` would).

``length_reward`` is deterministic in the response text. It raises for prompt groups whose
metadata asks for it: ``{"fail": true}`` on every call, ``{"fail_once": KEY}`` on the first call
for KEY in this process — which is how the tests exercise FAILED samples.
"""

import threading

_lock = threading.Lock()
_seen: set = set()


def length_reward(prompt: str, response: str, metadata: dict) -> float:
    """``(len(response) % 7) / 7``; raises RuntimeError as described in the module docstring."""
    if metadata.get("fail"):
        raise RuntimeError("reward function exploded on purpose")
    key = metadata.get("fail_once")
    if key is not None:
        with _lock:
            first = key not in _seen
            _seen.add(key)
        if first:
            raise RuntimeError(f"reward function exploded once for {key}")
    return (len(response) % 7) / 7.0
