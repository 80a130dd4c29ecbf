"""The simulated service time of an environment-server call: :class:`LatencyModel`.

A real agent's tool runs in a sandbox (a container or microVM per call or per episode), and its
latency is the sandbox's: seconds, with a tail. asyncrl's environment server reproduces that
latency from a **documented distribution** (``agent.env_server.latency``), not a hidden sleep:

* ``none`` — no added latency;
* ``constant`` — every call takes ``median_seconds``;
* ``lognormal`` — ln(latency) ~ Normal(ln(median_seconds), sigma^2), optionally clipped at
  ``max_seconds``. Measured sandbox start-and-exec times are right-skewed with a multiplicative
  spread; their logarithms are close to normal, so two numbers (the median and the spread of
  the logs) describe them.

The shipped values (:data:`MEASURED`) are maximum-likelihood lognormal fits (mu = mean of ln t,
sigma = population standard deviation of ln t) to the raw per-iteration "time to interactive"
(create a sandbox, run ``node -v``, 100 sequential iterations per provider) published by the
ComputeSDK sandbox benchmarks: github.com/computesdk/benchmarks, file
``results/sequential_tti/2026-05-05.json`` at commit ``0a010e00a96d2a6fbbaa148648313258064f7bdc``
(MIT license; method in its ``METHODOLOGY.md``). docs/agents.md gives the table, the other
sources consulted, and why ``configs/smollm2_calculator_remote.yaml`` uses the Modal fit.

Draws are deterministic per call: the latency of call ``call_id`` is drawn from a generator
seeded with ``(seed, call_id)``, so a replayed call (an episode resumed by durable replay calls
its tools again) waits as long as the first time, and a run's latencies do not depend on the
order in which concurrent calls arrive.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Any

__all__ = ["LatencyModel", "MEASURED", "MeasuredLatency", "fit_lognormal"]


@dataclass(frozen=True)
class MeasuredLatency:
    """A published latency measurement and its lognormal fit (seconds).

    Attributes:
        name: the provider as the source names it.
        n: iterations measured.
        median, p95, p99: the source's own summary of the measured times; max: the largest.
        fit_median: exp(mean of ln t), the fitted lognormal's median.
        fit_sigma: standard deviation of ln t.
    """

    name: str
    n: int
    median: float
    p95: float
    p99: float
    max: float
    fit_median: float
    fit_sigma: float


#: Lognormal fits to the ComputeSDK sequential time-to-interactive (create + first command), run
#: of 2026-05-05 (see the module docstring for the file and commit). Seconds.
MEASURED: dict[str, MeasuredLatency] = {
    m.name: m for m in (
        MeasuredLatency("daytona", 100, 0.186, 0.492, 0.560, 0.733, 0.220, 0.469),
        MeasuredLatency("e2b", 100, 0.491, 0.685, 0.740, 0.980, 0.511, 0.205),
        MeasuredLatency("vercel", 100, 0.671, 1.062, 1.315, 1.664, 0.732, 0.269),
        MeasuredLatency("modal", 100, 1.723, 2.309, 2.494, 4.776, 1.737, 0.233),
        MeasuredLatency("cloudflare", 100, 2.056, 2.969, 3.476, 5.306, 2.067, 0.286),
    )
}


def fit_lognormal(seconds: list[float]) -> tuple[float, float]:
    """Maximum-likelihood lognormal fit of measured latencies.

    Args:
        seconds: (N,) positive latencies in seconds, N >= 2.

    Returns:
        ``(median, sigma)``: exp(mean of ln t) and the population standard deviation of ln t
        (the maximum-likelihood estimates), the two numbers of ``agent.env_server.latency``.

    Raises:
        ValueError: fewer than two values, or a value that is not a positive finite number.
    """
    if len(seconds) < 2:
        raise ValueError(f"fit_lognormal needs at least 2 latencies, got {len(seconds)}")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in seconds):
        raise ValueError("fit_lognormal needs positive finite latencies")
    logs = [math.log(x) for x in seconds]
    mu = sum(logs) / len(logs)
    sigma = math.sqrt(sum((v - mu) ** 2 for v in logs) / len(logs))
    return math.exp(mu), sigma


class LatencyModel:
    """Draws the service time of one call (module docstring).

    Args:
        distribution: ``none``, ``constant`` or ``lognormal``.
        median_seconds: the median (``constant``: the value); > 0 unless ``none``.
        sigma: ``lognormal``: standard deviation of ln(latency), >= 0.
        max_seconds: clip of each draw (None: none).
        seed: with the call id, seeds each draw.

    Raises:
        ValueError: an unknown distribution, a negative parameter, or ``median_seconds <= 0``
            for a distribution other than ``none``.
    """

    def __init__(self, distribution: str = "none", median_seconds: float = 0.0, sigma: float = 0.0,
                 max_seconds: float | None = None, seed: int = 0) -> None:
        if distribution not in ("none", "constant", "lognormal"):
            raise ValueError(f"unknown latency distribution {distribution!r}: none, constant or lognormal")
        if median_seconds < 0 or sigma < 0 or (max_seconds is not None and max_seconds <= 0):
            raise ValueError("latency median_seconds and sigma must be >= 0 and max_seconds > 0")
        if distribution != "none" and median_seconds <= 0:
            raise ValueError(f"latency distribution {distribution!r} needs median_seconds > 0")
        self.distribution = distribution
        self.median_seconds = float(median_seconds)
        self.sigma = float(sigma)
        self.max_seconds = None if max_seconds is None else float(max_seconds)
        self.seed = int(seed)

    @classmethod
    def from_config(cls, latency: Any) -> "LatencyModel":
        """From the ``agent.env_server.latency`` config section."""
        return cls(latency.distribution, latency.median_seconds, latency.sigma, latency.max_seconds, latency.seed)

    def sample(self, call_id: str) -> float:
        """The latency of call ``call_id`` in seconds (>= 0); the same for the same id and seed."""
        if self.distribution == "none":
            return 0.0
        if self.distribution == "constant":
            value = self.median_seconds
        else:
            digest = hashlib.sha256(f"{self.seed}:{call_id}".encode()).digest()
            rng = random.Random(int.from_bytes(digest[:8], "little"))
            value = self.median_seconds * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return value if self.max_seconds is None else min(value, self.max_seconds)

    def quantile(self, q: float) -> float:
        """The q-quantile of the distribution in seconds (0 < q < 1), clip included.

        Raises:
            ValueError: q outside (0, 1).
        """
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile q must be in (0, 1), got {q}")
        if self.distribution == "none":
            return 0.0
        from statistics import NormalDist

        value = self.median_seconds if self.distribution == "constant" else \
            self.median_seconds * math.exp(self.sigma * NormalDist().inv_cdf(q))
        return value if self.max_seconds is None else min(value, self.max_seconds)

    def mean(self) -> float:
        """The mean latency in seconds without the clip (lognormal: median * exp(sigma^2 / 2))."""
        if self.distribution == "none":
            return 0.0
        return self.median_seconds * (math.exp(self.sigma ** 2 / 2) if self.distribution == "lognormal" else 1.0)

    def describe(self) -> str:
        """One line for logs: the distribution, its median, p95 and clip."""
        if self.distribution == "none":
            return "no added latency"
        clip = f", clipped at {self.max_seconds:g} s" if self.max_seconds is not None else ""
        if self.distribution == "constant":
            return f"constant {self.median_seconds:g} s{clip}"
        return (f"lognormal median {self.median_seconds:g} s, sigma {self.sigma:g} (p95 {self.quantile(0.95):.3g} s)"
                f"{clip}")
