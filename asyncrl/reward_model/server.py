"""The reward-model server: an HF sequence-classification model behind ``POST /score``, with a dynamic batcher.

Endpoints (aiohttp):

* ``POST /score`` — body ``{"texts": ["...", ...]}`` (:func:`score_request_model`: 1 to
  ``reward.model.max_texts_per_request`` strings of at most ``reward.model.max_chars``
  characters, nothing else); answer ``{"scores": [float, ...], "model": NAME}``, one raw score
  per text in order. 400 ``{"error": {"message": ...}}`` names what to fix; 415 for a compressed
  body (any ``Content-Encoding`` but ``identity``, refused before auth and never inflated); 401
  ``{"error": "Unauthorized"}`` without the bearer token when one is required (the rollout
  server's scheme: ``Authorization: Bearer <security.api_key>`` or ``x-api-key``); 503 while
  draining; 500 when the forward pass fails on one of the request's texts.
* ``GET /health`` — 200 ``{"status": "ok"}`` once the model is loaded, 503 while draining.
* ``GET /metrics`` — Prometheus text format (:class:`asyncrl.metrics.RewardModelMetrics`).

**Scoring.** Each text is tokenized without adding special tokens (the rollout worker sends
the prompt as rendered by the chat template, special tokens included, followed by the
response), cut to its last ``reward.model.max_length`` tokens, and scored by
``AutoModelForSequenceClassification``; the score is logit ``reward.model.label_index`` of the
sequence (transformers pools decoder models at the last non-padding token). A batch is padded
on the right with an attention mask, so a text's score in a batch equals its score alone up to
float rounding (tests/test_reward_model.py checks it against a direct forward pass).

**Dynamic batching** (:class:`DynamicBatcher`): texts of all requests go into one queue; a
forward pass takes up to ``max_batch_size`` of them, waiting at most ``batch_wait_ms`` after
the first for more. Forward passes run one at a time on a dedicated thread (the event loop
keeps answering). When a batch fails, its texts are retried one by one, so one bad text fails
only its own request.

**Drain** (:meth:`RewardModelServer.drain`, SIGTERM): new ``/score`` requests get 503 and
``/health`` turns 503 (a Kubernetes readiness probe takes the pod out of its Service), the texts
already queued are scored and answered, then the process exits — within
``reward.model.drain_timeout_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints, ValidationError, create_model

from asyncrl.core.net import content_encoding_refusal, key_matches, presented_key

__all__ = ["RewardModelOptions", "RewardModelServer", "DynamicBatcher", "score_request_model", "load_reward_model"]

log = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/metrics")


def score_request_model(max_texts: int, max_chars: int) -> type[BaseModel]:
    """The pydantic schema of a ``POST /score`` body: ``{"texts": [str, ...]}``, bounded.

    Strict (a number is not a text), unknown keys rejected, 1..``max_texts`` texts of at most
    ``max_chars`` characters each.
    """
    text = Annotated[str, StringConstraints(max_length=max_chars)]
    return create_model(
        "ScoreRequest",
        __config__=ConfigDict(extra="forbid", strict=True),
        texts=(list[text], Field(min_length=1, max_length=max_texts)),
    )


@dataclass
class RewardModelOptions:
    """Settings of one reward-model server (from ``reward.model``, :meth:`from_config`).

    Attributes:
        model_path: the HF directory of the sequence-classification model.
        host, port: where to listen (port 0: a free port).
        label_index: which output logit is the score.
        max_length: tokens kept per text (the last ones).
        max_batch_size, batch_wait_ms: the dynamic batcher's limits.
        max_texts_per_request, max_chars: the request schema's bounds.
        threads: torch threads (None: torch's default).
        device: ``auto``, ``cpu`` or ``cuda``.
        drain_timeout_seconds: longest drain on SIGTERM.
        api_key: bearer token required on ``/score`` (None: open).
    """

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30500
    label_index: int = 0
    max_length: int = 2048
    max_batch_size: int = 16
    batch_wait_ms: float = 5.0
    max_texts_per_request: int = 64
    max_chars: int = 200_000
    threads: int | None = None
    device: str = "auto"
    drain_timeout_seconds: float = 30.0
    api_key: SecretStr | None = None

    @classmethod
    def from_config(cls, cfg: Any, model_path: str) -> "RewardModelOptions":
        """From the whole config (``reward.model`` and, when required, ``security.api_key``)."""
        rm = cfg.reward.model
        from asyncrl.core.secret_values import reveal

        key = reveal(cfg.security.api_key) if rm.api_key_required else None
        return cls(model_path=model_path, host=rm.host, port=rm.port, label_index=rm.label_index,
                   max_length=rm.max_length, max_batch_size=rm.max_batch_size, batch_wait_ms=rm.batch_wait_ms,
                   max_texts_per_request=rm.max_texts_per_request, max_chars=rm.max_chars, threads=rm.threads, device=rm.device,
                   drain_timeout_seconds=rm.drain_timeout_seconds, api_key=SecretStr(key) if key else None)


def load_reward_model(model_path: str) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``: ``AutoModelForSequenceClassification`` in fp32, eval mode.

    A tokenizer without a padding token pads with its EOS token (the model's ``pad_token_id`` is
    set to match, so transformers pools at the last real token).

    Raises:
        ValueError: the directory holds no sequence-classification model (or one whose head's
            weights are missing, such as a causal LM), or neither a padding nor an EOS token is
            defined.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=torch.float32,
                                                                         output_loading_info=True)
        tok = AutoTokenizer.from_pretrained(model_path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"reward.model.path={model_path}: cannot load it as a sequence-classification model "
                         f"(AutoModelForSequenceClassification) and its tokenizer: {exc}") from exc
    if info.get("missing_keys"):  # e.g. a causal LM: its classification head would be random
        raise ValueError(f"reward.model.path={model_path}: the checkpoint has no weights for "
                         f"{sorted(info['missing_keys'])[:4]}: it is not a trained sequence-classification "
                         "(reward) model")
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ValueError(f"reward.model.path={model_path}: the tokenizer has neither a padding nor an EOS token")
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.pad_token_id
    model.eval()
    return model, tok


class DynamicBatcher:
    """Gathers texts of concurrent requests into forward passes (see the module docstring).

    Args:
        score_batch: blocking ``list[str] -> list[float]`` (one forward pass); runs on a
            dedicated thread, one call at a time.
        max_batch_size: most texts per call.
        batch_wait_seconds: how long to wait after the first text for more.
        metrics: optional :class:`asyncrl.metrics.RewardModelMetrics` (``queue_texts``).
    """

    def __init__(self, score_batch: Any, max_batch_size: int, batch_wait_seconds: float, metrics: Any = None):
        self.score_batch = score_batch
        self.max_batch_size = int(max_batch_size)
        self.batch_wait_seconds = float(batch_wait_seconds)
        self.metrics = metrics
        self._queue: asyncio.Queue[tuple[str, asyncio.Future]] = asyncio.Queue()
        self._pending = 0  # texts queued or in the forward pass
        self._idle = asyncio.Event()
        self._idle.set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-rm-forward")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="rm-batcher")

    @property
    def pending(self) -> int:
        """Texts queued or in the forward pass."""
        return self._pending

    async def score(self, texts: list[str]) -> list[float]:
        """Queue ``texts`` and wait for their scores (in order).

        Raises:
            Exception: the forward pass failed on one of these texts (alone).
        """
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in texts]
        self._set_pending(self._pending + len(texts))
        for t, f in zip(texts, futures):
            self._queue.put_nowait((t, f))
        return list(await asyncio.gather(*futures))

    async def wait_idle(self, timeout_seconds: float) -> bool:
        """Wait until nothing is queued or running; False when ``timeout_seconds`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_seconds)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        """Stop the loop (queued texts are failed) and the forward thread."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while not self._queue.empty():
            _, f = self._queue.get_nowait()
            if not f.done():
                f.set_exception(RuntimeError("the reward-model server stopped"))
        self._pool.shutdown(wait=True)

    def _set_pending(self, n: int) -> None:
        self._pending = n
        if n == 0:
            self._idle.set()
        else:
            self._idle.clear()
        if self.metrics is not None:
            self.metrics.queue_texts.set(n)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.batch_wait_seconds
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), left))
                except asyncio.TimeoutError:
                    break
            live = [(t, f) for t, f in batch if not f.done()]  # a cancelled request's texts are skipped
            try:
                if live:
                    await self._forward(loop, live)
            finally:
                self._set_pending(self._pending - len(batch))

    async def _forward(self, loop: asyncio.AbstractEventLoop, items: list[tuple[str, asyncio.Future]]) -> None:
        try:
            scores = await loop.run_in_executor(self._pool, self.score_batch, [t for t, _ in items])
            results: list[Any] = list(scores)
        except Exception as exc:
            if len(items) == 1:
                results = [exc]
            else:  # find the text(s) that fail: one bad text must not fail the other requests
                log.warning("a reward-model batch of %d texts failed (%s); scoring them one by one", len(items), exc)
                results = []
                for t, _ in items:
                    try:
                        results.extend(await loop.run_in_executor(self._pool, self.score_batch, [t]))
                    except Exception as one:
                        results.append(one)
        for (_, f), res in zip(items, results):
            if f.done():
                continue
            if isinstance(res, BaseException):
                f.set_exception(res)
            else:
                f.set_result(float(res))


class RewardModelServer:
    """The HTTP layer and the model of one reward-model server (see the module docstring).

    Args:
        opts: :class:`RewardModelOptions`.
        model, tokenizer: already loaded (tests); None loads ``opts.model_path`` in :meth:`load`.
        metrics: optional :class:`asyncrl.metrics.RewardModelMetrics`; ``registry`` its registry.
    """

    def __init__(self, opts: RewardModelOptions, model: Any = None, tokenizer: Any = None,
                 metrics: Any = None, registry: Any = None):
        self.opts = opts
        self.model, self.tokenizer = model, tokenizer
        self.metrics, self.registry = metrics, registry
        self.schema = score_request_model(opts.max_texts_per_request, opts.max_chars)
        self.batcher: DynamicBatcher | None = None
        self.draining = False
        self.ready = False
        self.answered = 0  # /score requests answered with scores or a 500
        self.device: Any = "cpu"

    # -- model ---------------------------------------------------------------------------------

    def load(self) -> None:
        """Load model and tokenizer (unless given) and set torch's threads; blocking."""
        import torch

        if self.opts.threads:
            torch.set_num_threads(int(self.opts.threads))
        if self.model is None:
            self.model, self.tokenizer = load_reward_model(self.opts.model_path)
        want = self.opts.device
        if want == "cuda" and not torch.cuda.is_available():
            raise ValueError("reward.model.device=cuda but no GPU is visible (CUDA_VISIBLE_DEVICES, drivers); "
                             "use device auto or cpu")
        self.device = torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")
        self.model.to(self.device)
        n_labels = int(getattr(self.model.config, "num_labels", 1))
        if self.opts.label_index >= n_labels:
            raise ValueError(f"reward.model.label_index={self.opts.label_index} but the model has {n_labels} "
                             "output label(s)")

    def score_batch(self, texts: list[str]) -> list[float]:
        """One forward pass: the raw score of each text (blocking; see the module docstring).

        Shapes: ``input_ids``/``attention_mask`` ``[len(texts), longest]`` (right padding),
        logits ``[len(texts), num_labels]``; returns ``logits[:, label_index]`` as floats.
        """
        import torch

        t0 = time.perf_counter()
        enc = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        ids = [row[-self.opts.max_length:] or [self.tokenizer.pad_token_id] for row in enc]
        width = max(len(r) for r in ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in ids], dtype=torch.long)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids], dtype=torch.long)
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits
        scores = logits[:, self.opts.label_index].float().tolist()
        if self.metrics is not None:
            self.metrics.batch_done(len(texts), sum(len(r) for r in ids), time.perf_counter() - t0)
        return scores

    # -- HTTP ----------------------------------------------------------------------------------

    @web.middleware
    async def auth_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The shared guards of asyncrl's servers (:mod:`asyncrl.core.net`), before a byte of the body is read:
        a ``Content-Encoding`` other than ``identity`` is a 415 naming it; then ``Authorization: Bearer
        <key>`` (or ``x-api-key``) on every path but ``/health`` and ``/metrics``: 401 without the key,
        400 naming the header when it holds non-ASCII characters. A refused request's connection is
        closed, never lingered on to read its body (:data:`asyncrl.core.net.SERVER_KWARGS`)."""
        refusal = content_encoding_refusal(request.headers)
        if refusal is not None:
            self._count("bad_request")
            resp = self._bad(refusal, 415)
            resp.force_close()
            return resp
        key = self.opts.api_key
        if key is not None and request.path not in _OPEN_PATHS:
            header, given = presented_key(request.headers)
            if given is None:
                self._count("bad_request")
                resp = self._bad(f"the {header} header holds non-ASCII characters: send the API key as it was "
                                 "given (ASCII)")
                resp.force_close()
                return resp
            if not key_matches(given, key.get_secret_value()):
                self._count("unauthorized")
                resp = web.json_response({"error": "Unauthorized"}, status=401)
                if request.body_exists:
                    resp.force_close()
                return resp
        return await handler(request)

    def _count(self, result: str, seconds: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.request_done(result, seconds)

    @staticmethod
    def _bad(message: str, status: int = 400) -> web.Response:
        return web.json_response({"error": {"message": message}}, status=status)

    async def handle_score(self, request: web.Request) -> web.Response:
        """``POST /score`` (see the module docstring)."""
        t0 = time.perf_counter()
        if self.draining or self.batcher is None:
            self._count("draining")
            return self._bad("the reward-model server is draining (shutting down); retry on another", 503)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._count("bad_request")
            return self._bad(f"request body too large: at most {self.opts.max_texts_per_request} texts of "
                             f"{self.opts.max_chars} characters (reward.model.max_texts_per_request/max_chars)")
        try:
            req = self.schema.model_validate_json(body)
        except ValidationError as exc:
            self._count("bad_request")
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return self._bad(f"invalid /score request: {where}: {first['msg']} (expected {{\"texts\": [str, ...]}} "
                             f"with 1..{self.opts.max_texts_per_request} texts of at most {self.opts.max_chars} "
                             "characters)")
        try:
            scores = await self.batcher.score(req.texts)
        except Exception as exc:
            self.answered += 1
            self._count("error")
            log.warning("a /score request failed in the forward pass: %s: %s", type(exc).__name__, exc)
            return self._bad(f"the reward model failed on this request: {type(exc).__name__}: {exc}", 500)
        self.answered += 1
        self._count("ok", time.perf_counter() - t0)
        return web.json_response({"scores": scores, "model": self.opts.model_path})

    async def handle_health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 when loaded and serving, 503 while loading or draining."""
        if self.draining or not self.ready:
            return web.json_response({"status": "draining" if self.draining else "loading"}, status=503)
        return web.json_response({"status": "ok"})

    def app(self) -> web.Application:
        """The aiohttp application; starts the batcher when the app starts."""
        from asyncrl.metrics import metrics_app_handler

        limit = self.opts.max_texts_per_request * (6 * self.opts.max_chars + 8) + 4096  # \\uXXXX escapes
        app = web.Application(middlewares=[self.auth_middleware], client_max_size=limit)
        app.router.add_post("/score", self.handle_score)
        app.router.add_get("/health", self.handle_health)
        if self.registry is not None:
            app.router.add_get("/metrics", metrics_app_handler(self.registry))

        async def on_startup(_: web.Application) -> None:
            self.batcher = DynamicBatcher(self.score_batch, self.opts.max_batch_size, self.opts.batch_wait_ms / 1000.0,
                                          self.metrics)
            self.batcher.start()
            self.ready = True

        async def on_cleanup(_: web.Application) -> None:
            if self.batcher is not None:
                await self.batcher.close()

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app

    async def drain(self) -> bool:
        """Refuse new requests (503) and wait until every queued text is scored and answered.

        Returns False when ``drain_timeout_seconds`` passed with texts still queued (the caller
        stops anyway; those requests fail and their samples are FAILED by the workers).
        """
        self.draining = True
        if self.batcher is None:
            return True
        done = await self.batcher.wait_idle(self.opts.drain_timeout_seconds)
        await asyncio.sleep(0.05)  # let the handlers write the answers of the last batch
        return done
