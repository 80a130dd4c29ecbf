"""Named LoRA adapters of the embedded engine, applied per request (SGLang's ``lora_path``).

One job: let one engine serve several PEFT LoRA adapters at once, each request naming the one it
samples from, the way SGLang does (``/load_lora_adapter``, ``/unload_lora_adapter`` and
``lora_path`` on ``/generate``: https://docs.sglang.io/advanced_features/lora.html). The
rollout worker's SGLang adapter path (``rollout_server/worker_weights.py``) is tested against this.

How: the base weights stay untouched. Every targeted ``nn.Linear`` gets one forward hook that
adds ``scaling * (x @ A^T) @ B^T`` to the rows of the batch whose request named an adapter
targeting that module (PEFT's ``LoraLayer.forward``, Hu et al. 2021, arXiv 2106.09685), so one
decode step serves rows of different adapters, and rows without one get the base model. A row
holds its adapter object from admission to its end, so unloading a name never changes a request
already running (SGLang waits for such requests before it unloads; here they keep their
reference and the name is gone for new requests at once).

Named adapters and a merged adapter (``/update_weights_from_disk`` of an adapter-only version,
:mod:`rollout_server.engine_weights`) exclude each other: both at once would apply the named
adapter on top of another adapter, not on the base model, so whichever comes second is refused (400).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rollout_server.sampling import RequestError

__all__ = ["EngineLora", "NamedAdapter"]


@dataclass(eq=False)
class NamedAdapter:
    """One registered adapter: per targeted module ``(A (r, in), B (out, r))`` on the engine's device and dtype."""

    name: str
    path: str
    checksum: str
    scaling: float
    rank: int
    modules: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def info(self) -> dict:
        """What ``/get_model_info`` and the load answer report about it (no tensors)."""
        return {"name": self.name, "path": self.path, "checksum": self.checksum, "rank": self.rank,
                "scaling": self.scaling, "modules": len(self.modules)}


class EngineLora:
    """Named adapters (mixin of :class:`rollout_server.engine.Engine`; see the module docstring).

    Expects ``torch``, ``model``, ``dtype``, ``device``, ``_lora_base``, ``_rows``,
    ``max_loaded_loras`` and ``_parse_adapter`` (:mod:`rollout_server.engine_weights`) on the
    engine. ``named_adapters`` (name -> :class:`NamedAdapter`) is read by the HTTP layer.
    """

    def _init_lora(self, max_loaded_loras: int) -> None:
        self.max_loaded_loras = int(max_loaded_loras)
        self.named_adapters: dict[str, NamedAdapter] = {}
        self._lora_hooks: dict[str, Any] = {}  # module name -> hook handle
        self._lora_rows: list | None = None  # per batch row: its NamedAdapter or None, during a forward

    # -- commands (engine thread) --------------------------------------------------------------

    def _cmd_load_lora(self, name: str, path: str, adapter: dict, config: dict, checksum: str, fut: Future) -> dict:
        """Register ``adapter`` under ``name``; returns ``{name: path}`` of every registered adapter.

        Raises:
            RequestError: the name is taken, ``max_loaded_loras`` adapters are registered, a
                merged adapter is loaded, or the adapter does not fit the model
                (:meth:`rollout_server.engine_weights.EngineWeights._parse_adapter`'s reasons).
        """
        if name in self.named_adapters:
            raise RequestError(f"LoRA adapter {name!r} is already loaded; unload it first (loaded: {sorted(self.named_adapters)})")
        if len(self.named_adapters) >= self.max_loaded_loras:
            raise RequestError(f"{len(self.named_adapters)} LoRA adapters are loaded, at most {self.max_loaded_loras} "
                               "(--max-loaded-loras): unload one first")
        if self._lora_base:
            raise RequestError("a merged LoRA adapter is loaded (/update_weights_from_disk of an adapter directory): named "
                               "adapters apply to the base weights; load the base weights first")
        pairs, rank, scaling = self._parse_adapter(adapter, config)
        torch = self.torch
        mods = dict(self.model.named_modules())
        entry = NamedAdapter(name, path, checksum, scaling, rank)
        for module, (a, b) in pairs.items():
            if not isinstance(mods.get(module), torch.nn.Linear):
                raise RequestError(f"adapter targets {module!r}, a {type(mods.get(module)).__name__}: named adapters "
                                   "apply to nn.Linear modules only")
            w = mods[module].weight
            entry.modules[module] = (a.detach().to(device=w.device, dtype=w.dtype).contiguous(),
                                     b.detach().to(device=w.device, dtype=w.dtype).contiguous())
            for t in entry.modules[module]:
                if not bool(torch.isfinite(t).all()):
                    raise RequestError(f"adapter {module!r} holds NaN or inf values")
        for module in entry.modules:
            if module not in self._lora_hooks:
                self._lora_hooks[module] = mods[module].register_forward_hook(self._lora_hook(module))
        self.named_adapters[name] = entry
        return self.loaded_lora_paths()

    def _cmd_unload_lora(self, name: str, fut: Future) -> dict:
        """Forget ``name`` (requests running under it keep their adapter to their end); returns the registered set.

        Raises:
            RequestError: no adapter of that name is loaded.
        """
        if name not in self.named_adapters:
            raise RequestError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.named_adapters)})")
        del self.named_adapters[name]
        return self.loaded_lora_paths()

    def loaded_lora_paths(self) -> dict[str, str]:
        """``{name: path}`` of the registered adapters (SGLang's ``loaded_adapters``)."""
        return {n: a.path for n, a in list(self.named_adapters.items())}  # list(): one C-level copy (HTTP thread)

    def _resolve_adapters(self, samples: list) -> list:
        """Bind each sample's ``lora_name`` to its registered adapter at submission; the samples whose
        name is gone (unloaded between the HTTP check and now) are returned, to fail with a 400."""
        gone = []
        for s in samples:
            if s.lora_name is not None and s.adapter is None:
                s.adapter = self.named_adapters.get(s.lora_name)
                if s.adapter is None:
                    gone.append(s)
        return gone

    # -- forward -------------------------------------------------------------------------------

    def _forward_with_adapters(self, rows: list, **kwargs: Any) -> Any:
        """``self.model(**kwargs)`` with ``rows[i]`` (a :class:`NamedAdapter` or None) applied to batch row i."""
        if not any(a is not None for a in rows):
            return self.model(**kwargs)
        self._lora_rows = rows
        try:
            return self.model(**kwargs)
        finally:
            self._lora_rows = None

    def _lora_hook(self, module: str):
        torch = self.torch

        def hook(mod: Any, inputs: tuple, output: Any) -> Any:
            rows = self._lora_rows
            if rows is None:
                return output
            x = inputs[0]
            groups: dict[int, tuple[NamedAdapter, list[int]]] = {}
            for i, a in enumerate(rows):
                if a is not None and module in a.modules:
                    groups.setdefault(id(a), (a, []))[1].append(i)
            for a, idx in groups.values():
                A, B = a.modules[module]
                if len(idx) == x.shape[0]:
                    output = output + (x @ A.t()) @ B.t() * a.scaling
                    continue
                sel = torch.tensor(idx, dtype=torch.long, device=x.device)
                delta = (x.index_select(0, sel) @ A.t()) @ B.t() * a.scaling
                output = output.index_add(0, sel, delta)
            return output

        return hook
