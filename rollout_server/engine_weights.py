"""Weight updates of the embedded engine: validate a (partial) state dict, then load it between steps.

One job: change the engine's weights safely. :class:`EngineWeights` is a mixin of
:class:`rollout_server.engine.Engine`; its ``update_weights`` command runs in the engine thread.
An update is validated and converted completely (names, shapes, floating dtypes, finite values,
tied aliases) before the first copy, so a rejected update changes nothing; it is applied once
the running batch drains (SGLang's writer lock) or at once when the engine is idle or paused.
"""

from __future__ import annotations

from concurrent.futures import Future

from rollout_server.sampling import RequestError

__all__ = ["DEFERRED", "EngineWeights"]


class _Deferred:
    """Type of :data:`DEFERRED`, the marker for a weight load postponed until the engine is idle."""


#: What a control command returns when it sets its Future itself later (a weight update waiting
#: for the running batch to drain).
DEFERRED = _Deferred()


class EngineWeights:
    """Weight validation and loading (mixin of :class:`rollout_server.engine.Engine`).

    Expects ``torch``, ``model``, ``dtype``, ``weight_version``, ``_rows``, ``_paused``,
    ``_pending_updates``, ``load()``, ``_abort()`` and ``_publish()`` on the engine.
    """

    def _cmd_update_weights(self, state: dict, version: str | None, abort_all: bool, fut: Future):
        """Load ``state`` now if idle or paused, else once the running batch drains (writer lock)."""
        state = self._validate_state(state)  # before anything else: a rejected update changes nothing
        if abort_all:
            self._publish(self._abort("", True))
        self._pending_updates.append((state, version, fut))
        self._apply_pending_updates()
        return DEFERRED

    def _apply_pending_updates(self) -> None:
        if not self._pending_updates:
            return
        if self._paused is None and any(r is not None for r in self._rows):
            return  # wait for the running requests (SGLang holds the writer lock)
        torch = self.torch
        while self._pending_updates:
            state, version, fut = self._pending_updates.pop(0)
            try:
                params = self._named_tensors()
                with torch.no_grad():  # validated and converted beforehand: copies cannot fail half-way
                    for name, tensor in state.items():
                        params[name].copy_(tensor)
                if version is not None:
                    self.weight_version = str(version)
                paused = self.load()
                fut.set_result({"num_paused_requests": paused["num_running_reqs"] + paused["num_waiting_reqs"]})
            except Exception as exc:  # pragma: no cover - validated beforehand
                fut.set_exception(exc)

    def _named_tensors(self) -> dict:
        """Every loadable tensor by name, tied aliases included (``lm_head.weight`` of tied embeddings)."""
        return dict(self.model.state_dict(keep_vars=True))

    def _validate_state(self, state: dict) -> dict:
        """Check a (possibly partial) weight update and convert it to the model's dtype.

        A partial update (a subset of the parameters, as slime's bucketed updates and SGLang's
        ``/update_weights_from_tensor`` send) changes only the named tensors. Tied aliases
        (``lm_head.weight`` of tied embeddings) name the same tensor; giving both with different
        values is refused.

        Returns:
            ``{name: tensor}`` in the model's dtype, ready to copy (nothing is applied here).

        Raises:
            RequestError: an empty update, unknown names, shape mismatches, non-floating dtypes,
                NaN/inf values, or inconsistent tied aliases; the message names the tensors.
        """
        torch = self.torch
        if not state:
            raise RequestError("the weight update holds no tensor")
        params = self._named_tensors()
        unknown = sorted(set(state) - set(params))
        if unknown:
            raise RequestError(
                f"weights contain {len(unknown)} unknown parameter(s) {unknown[:5]} (model has e.g. {next(iter(params))})"
            )
        bad = [f"{n}: got {tuple(t.shape)}, model {tuple(params[n].shape)}" for n, t in state.items() if tuple(t.shape) != tuple(params[n].shape)]
        if bad:
            raise RequestError("shape mismatch: " + "; ".join(bad[:5]))
        kinds = [f"{n}: {t.dtype}" for n, t in state.items() if not (t.is_floating_point())]
        if kinds:
            raise RequestError("weights must be floating point tensors: " + "; ".join(kinds[:5]))
        out: dict = {}
        nonfinite = []
        for name, t in state.items():
            c = t.detach().to(device=params[name].device, dtype=params[name].dtype)  # checked where it will live
            if not bool(torch.isfinite(c).all()):
                nonfinite.append(f"{name} ({int((~torch.isfinite(c)).sum())} of {c.numel()} values)")
            out[name] = c
        if nonfinite:
            raise RequestError(
                "weights contain NaN or inf values (the trainer diverged, or a cast to the engine dtype "
                f"{str(self.dtype).replace('torch.', '')} overflowed): " + "; ".join(nonfinite[:5]) + "; the old weights are kept"
            )
        by_tensor: dict[int, str] = {}
        for name in out:
            key = id(params[name])
            other = by_tensor.setdefault(key, name)
            if other != name and not torch.equal(out[other], out[name]):
                raise RequestError(f"{other} and {name} are tied in this model (one tensor) but the update gives them different values")
        return out
