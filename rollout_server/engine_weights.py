"""Weight updates of the embedded engine: validate a (partial) state dict, then load it between steps.

One job: change the engine's weights safely. :class:`EngineWeights` is a mixin of
:class:`rollout_server.engine.Engine`; its ``update_weights`` command runs in the engine thread.
An update is validated and converted completely (names, shapes, floating dtypes, finite values,
tied aliases) before the first copy, so a rejected update changes nothing; it is applied once
the running batch drains (SGLang's writer lock) or at once when the engine is idle or paused.

LoRA (``trainer.lora``): an adapter-only version is merged into a copy of the base weights
(``update_adapter``; docs/trainer.md#lora): the merged model decodes at the base model's speed,
and the engine reports the adapter it holds (``lora_adapter``: its checksum and version). Named
adapters applied per request (SGLang's ``/load_lora_adapter``) are :mod:`rollout_server.engine_lora`;
both check an adapter with :meth:`EngineWeights._parse_adapter`.
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

    Expects ``torch``, ``model``, ``dtype``, ``weight_version``, ``lora_adapter``, ``_lora_base``,
    ``_rows``, ``_paused``, ``_pending_updates``, ``load()``, ``_abort()`` and ``_publish()`` on the engine.
    """

    def _cmd_update_weights(self, state: dict, version: str | None, abort_all: bool, flush_cache: bool = True, *,
                            fut: Future):
        """Load ``state`` now if idle or paused, else once the running batch drains (writer lock).

        Full weights replace a merged LoRA adapter: the tensors it was merged into get their base
        values back unless ``state`` gives them, and the engine reports no adapter afterwards.

        ``flush_cache`` (SGLang's field of the same name, true by default) empties the context
        cache; false keeps its keys/values of the old weights, to be extended under the new ones,
        as a request running across an in-place update is (``pause_mode: in_place``). The prompt
        cache is emptied either way: it holds the old weights' next-token logits.
        """
        state = self._validate_state(state)  # before anything else: a rejected update changes nothing
        if self._lora_base:
            state = {**self._lora_base, **state}
        if abort_all:
            self._publish(self._abort("", True))
        self._pending_updates.append((state, version, fut, None, bool(flush_cache)))
        self._apply_pending_updates()
        return DEFERRED

    def _cmd_update_adapter(self, adapter: dict, config: dict, checksum: str, version: str | None, abort_all: bool,
                            flush_cache: bool = True, *, fut: Future):
        """Merge a PEFT LoRA adapter into a copy of the base weights; loaded like full weights (writer lock).

        Each targeted weight becomes ``W_base + scaling * B @ A`` computed in fp32 from the base
        values kept at the first adapter (``scaling = lora_alpha / r``, or ``/ sqrt(r)`` with
        ``use_rslora``; PEFT's ``LoraLayer``), so adapters never compound; tensors a previous
        adapter targeted and this one does not get their base values back. After the load,
        ``lora_adapter`` reports ``checksum``, ``version`` and the merged module count.
        """
        merged, base, info = self._merge_adapter(adapter, config)
        info.update({"checksum": str(checksum), "version": None if version is None else str(version)})
        merged = {**{n: t for n, t in base.items() if n not in merged}, **merged}
        info["_base"] = base  # becomes the engine's base copy when this update is applied
        merged = self._validate_state(merged)
        if abort_all:
            self._publish(self._abort("", True))
        self._pending_updates.append((merged, version, fut, info, bool(flush_cache)))
        self._apply_pending_updates()
        return DEFERRED

    def _merge_adapter(self, adapter: dict, config: dict) -> tuple[dict, dict, dict]:
        """Check a PEFT LoRA adapter against the model and compute its merged weights (nothing applied).

        Args: as :meth:`_parse_adapter`.

        Returns:
            ``(merged {"<module>.weight": tensor}, base {name: base tensor}, info)``.

        Raises:
            RequestError: :meth:`_parse_adapter`'s reasons, or named adapters are loaded
                (``/load_lora_adapter``: a merge under them would compound; engine_lora.py).
        """
        torch = self.torch
        if getattr(self, "named_adapters", None):
            raise RequestError(f"named LoRA adapters are loaded ({sorted(self.named_adapters)}): a merged adapter would "
                               "apply under them; unload them first (/unload_lora_adapter)")
        pairs, r, scaling = self._parse_adapter(adapter, config)
        params = self._named_tensors()
        merged, base = {}, dict(self._lora_base or {})
        for module, (a, b) in sorted(pairs.items()):
            target = module + ".weight"
            w = params[target]
            if target not in base:
                base[target] = w.detach().clone()
            delta = (b.detach().to("cpu", torch.float32) @ a.detach().to("cpu", torch.float32)) * scaling
            merged[target] = (base[target].to(torch.float32) + delta).to(w.dtype)
        return merged, base, {"modules": len(merged), "rank": r, "scaling": scaling}

    def _parse_adapter(self, adapter: dict, config: dict) -> tuple[dict, int, float]:
        """Check a PEFT LoRA adapter against the model: its ``(A, B)`` pair per targeted module.

        Args:
            adapter: ``get_peft_model_state_dict`` tensors: ``base_model.model.<module>.lora_A.weight``
                (r, in_features) and ``...lora_B.weight`` (out_features, r) per targeted ``nn.Linear``.
            config: PEFT's ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``).

        Returns:
            ``({module: (A, B)}, r, scaling)`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with
            ``use_rslora``; PEFT's ``LoraLayer``); the tensors as given.

        Raises:
            RequestError: not a LoRA adapter, an option this engine does not implement (DoRA,
                fan_in_fan_out, rank/alpha patterns, biases, modules_to_save), an empty adapter,
                an A without its B, a module the model lacks, or shapes that do not fit.
        """
        if str(config.get("peft_type", "")).upper() != "LORA":
            raise RequestError(f"adapter_config.json has peft_type {config.get('peft_type')!r}; only LORA adapters load")
        unsupported = [k for k in ("use_dora", "fan_in_fan_out", "lora_bias") if config.get(k)]
        unsupported += [k for k in ("rank_pattern", "alpha_pattern") if config.get(k)]
        unsupported += ["modules_to_save"] if config.get("modules_to_save") else []
        unsupported += [f"bias={config.get('bias')!r}"] if config.get("bias", "none") != "none" else []
        if unsupported:
            raise RequestError(f"the embedded engine's LoRA support does not implement {', '.join(unsupported)}")
        r, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", 0))
        if r <= 0:
            raise RequestError(f"adapter_config.json has r={config.get('r')!r}; expected a positive rank")
        scaling = alpha / (r ** 0.5) if config.get("use_rslora") else alpha / r
        if not adapter:
            raise RequestError("the adapter holds no tensor")
        prefix = "base_model.model."
        pairs: dict[str, dict[str, object]] = {}
        for name, t in adapter.items():
            for part in ("A", "B"):
                suffix = f".lora_{part}.weight"
                if name.startswith(prefix) and name.endswith(suffix):
                    pairs.setdefault(name[len(prefix):-len(suffix)], {})[part] = t
                    break
            else:
                raise RequestError(f"adapter tensor {name!r} is not a LoRA A/B weight of a linear module "
                                   f"({prefix}<module>.lora_A.weight / .lora_B.weight)")
        params = self._named_tensors()
        out: dict[str, tuple] = {}
        for module, ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                raise RequestError(f"adapter module {module!r} has lora_{next(iter(ab))} without its pair")
            target = module + ".weight"
            if target not in params:
                raise RequestError(f"adapter targets {module!r}, which the model does not have (model has e.g. "
                                   f"{next(iter(params))})")
            a, b = ab["A"], ab["B"]
            w = params[target]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r or (b.shape[0], a.shape[1]) != tuple(w.shape):
                raise RequestError(f"adapter {module!r}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit rank {r} "
                                   f"and weight {tuple(w.shape)}")
            if not (a.is_floating_point() and b.is_floating_point()):
                raise RequestError(f"adapter {module!r}: A and B must be floating point tensors")
            out[module] = (a, b)
        return out, r, scaling

    def _apply_pending_updates(self) -> None:
        if not self._pending_updates:
            return
        if self._paused is None and any(r is not None for r in self._rows):
            return  # wait for the running requests (SGLang holds the writer lock)
        torch = self.torch
        while self._pending_updates:
            state, version, fut, adapter, flush = self._pending_updates.pop(0)
            try:
                params = self._named_tensors()
                with torch.no_grad():  # validated and converted beforehand: copies cannot fail half-way
                    for name, tensor in state.items():
                        params[name].copy_(tensor)
                # the prompt cache's logits are the old weights' next-token distribution: always
                # emptied; the context cache's keys/values only when the caller asked (flush_cache)
                caches = (getattr(self, "prompt_cache", None), getattr(self, "context_cache", None) if flush else None)
                for cache in caches:
                    if cache is not None:
                        cache.clear()
                # counts applied updates, named or not (a row records the epoch of its prefill)
                self.weights_epoch += 1
                if flush:  # rows prefilled before this update are never kept (prompt_cache._remember_context)
                    self.kv_flush_epoch = self.weights_epoch
                if version is not None:
                    self.weight_version = str(version)
                if adapter is not None:
                    adapter = dict(adapter)
                    self._lora_base = adapter.pop("_base")
                else:
                    self._lora_base = None  # full weights: no adapter left merged
                self.lora_adapter = adapter
                paused = self.load()
                fut.set_result({"num_paused_requests": paused["num_running_reqs"] + paused["num_waiting_reqs"],
                                "lora_adapter": adapter})
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
            if not _all_finite(torch, c):
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


def _all_finite(torch, t) -> bool:
    """True when ``t`` holds no NaN or infinity, in one pass that allocates nothing.

    ``torch.aminmax`` propagates NaN, and an infinity is the minimum or the maximum, so both
    ends are finite exactly when every value is. ``torch.isfinite(t).all()`` says the same but
    first writes a bool tensor as large as ``t``: for a 135M-parameter update on a loaded 2-core
    machine about 15x slower (docs/rollout.md, "Rollout profile"). Empty tensors are finite;
    a dtype ``aminmax`` does not support falls back to ``isfinite``.
    """
    if t.numel() == 0:
        return True
    try:
        lo, hi = torch.aminmax(t)
    except (RuntimeError, TypeError, NotImplementedError):  # e.g. a dtype without an aminmax kernel here
        return bool(torch.isfinite(t).all())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
