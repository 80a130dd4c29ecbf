"""``asyncrl buffer stats|inspect|drain``: look into (or empty) a run's replay buffer.

* ``stats``: counts by state, staleness histogram, partial ratio, oldest version in flight,
  drop/restart counts by reason, lineage (``--json`` for machines);
* ``inspect SAMPLE_ID``: one sample decoded (token ids, logprobs, versions, segments; the text
  too with ``--tokenizer PATH``);
* ``drain``: deletes every key of the run after confirmation (``--yes`` skips the prompt).

The run's stored settings are used (the CLI never changes them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

USAGE_EPILOG = (
    "examples: ASYNCRL_BUFFER__REDIS_URL=redis://:PASSWORD@127.0.0.1:6379/0 asyncrl buffer stats --run myrun --json "
    "(a password on the command line is visible to every user in `ps`: pass it in the environment; docs/security.md)"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl buffer", description=__doc__.split("\n\n")[0], epilog=USAGE_EPILOG)
    sub = parser.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis_url", default=os.environ.get("ASYNCRL_BUFFER__REDIS_URL"),
                        help="redis:// URL of the buffer (default: $ASYNCRL_BUFFER__REDIS_URL; put a URL with a "
                             "password there, not on the command line)")
    common.add_argument("--run", default="asyncrl", help="run name (key prefix asyncrl:{RUN}:), default asyncrl")
    common.add_argument("--json", action="store_true", help="machine-readable JSON output")
    sub.add_parser("stats", parents=[common], help="counts by state, staleness, partial ratio, drops, lineage")
    p_inspect = sub.add_parser("inspect", parents=[common], help="one sample decoded")
    p_inspect.add_argument("sample_id", help="sample id, <group_id>/<index>")
    p_inspect.add_argument("--tokenizer", default=None, help="tokenizer directory to decode the text")
    p_drain = sub.add_parser("drain", parents=[common], help="delete every key of the run")
    p_drain.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    return parser


def _print_stats(s: dict) -> None:
    print(f"run {s['run']}: policy version {s['version']}, lineage {s['lineage']}, dataset cursor {s['dataset_cursor']}")
    print("groups by state:  " + ", ".join(f"{k} {v}" for k, v in sorted(s["groups_by_state"].items())))
    print("samples by state: " + ", ".join(f"{k} {v}" for k, v in sorted(s["samples_by_state"].items())))
    print("queues:           " + ", ".join(f"{k} {v}" for k, v in s["queues"].items()))
    print(f"partial ratio {s['partial_ratio']:.3f}; oldest version in flight {s['oldest_version_in_flight']}")
    hist = s["staleness_histogram"]
    print("staleness (ready/batched groups): " + (", ".join(f"{k}: {v}" for k, v in hist.items()) or "none"))
    print("dropped by reason: " + (", ".join(f"{k} {v}" for k, v in s["dropped_by_reason"].items()) or "none"))
    print("restarted by reason: " + (", ".join(f"{k} {v}" for k, v in s["restarted_by_reason"].items()) or "none"))
    sm = s.get("sampling", {})
    if sm:
        print(f"finished groups {sm['finished_groups']}, zero-variance share {sm['zero_variance_share']:.3f}; "
              f"predicted zero-variance skips {sm['skipped_zero_variance_predicted']} (easy "
              f"{sm['predicted_skips_easy']}, hard {sm['predicted_skips_hard']}; share of visits "
              f"{sm['predicted_skip_share']:.3f})")
    skipped = {k.split(":", 1)[1]: v for k, v in s.get("counters", {}).items() if k.startswith("skipped_prompts:")}
    print("prompts skipped by reason: " + (", ".join(f"{k} {v}" for k, v in sorted(skipped.items())) or "none"))
    print(f"open batch {s['open_batch']}; last acknowledged step {s['last_acked_step']}; committed step {s['committed_step']}")


async def _amain(args: argparse.Namespace) -> int:
    from buffers import BufferError, ReplayBuffer

    try:
        buf = await ReplayBuffer.open(args.redis_url, args.run, None)
    except BufferError as exc:
        print(f"asyncrl buffer: {_redact(str(exc), args.redis_url)}", file=sys.stderr)
        return 1
    try:
        if args.action == "stats":
            s = await buf.stats()
            if args.json:
                print(json.dumps(s, indent=2, sort_keys=True))
            else:
                _print_stats(s)
            return 0
        if args.action == "inspect":
            try:
                sample = await buf.get_sample(args.sample_id)
            except BufferError as exc:
                print(f"asyncrl buffer: {exc}", file=sys.stderr)
                return 1
            from dataclasses import asdict

            d = asdict(sample)
            d["status"] = sample.status.value
            if args.tokenizer:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(args.tokenizer)
                d["text"] = tok.decode(sample.response_ids)
            if args.json:
                print(json.dumps(d, indent=2))
            else:
                for k, v in d.items():
                    print(f"{k}: {v}")
            return 0
        # drain
        if not args.yes:
            answer = input(f"delete every key of run {args.run!r} (asyncrl:{{{args.run}}}:*)? type the run name: ")
            if answer.strip() != args.run:
                print("asyncrl buffer: not drained", file=sys.stderr)
                return 1
        n = await buf.drain()
        print(json.dumps({"deleted_keys": n}) if args.json else f"drained run {args.run}: {n} keys deleted")
        return 0
    finally:
        await buf.close()


def _password_of(url: str | None) -> str | None:
    """The password of a redis:// URL (None: none, or not a URL)."""
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).password if url else None
    except ValueError:
        return None


def _redact(text: str, url: str) -> str:
    """``text`` with the URL's password (should an error message echo it) replaced by ``***``."""
    from urllib.parse import urlsplit

    try:
        password = urlsplit(url).password
    except ValueError:
        return text
    return text.replace(password, "***") if password else text


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl buffer``; returns the exit code (2: usage, 1: buffer error)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if any(x.split("=", 1)[0] == "--redis_url" for x in argv) and _password_of(args.redis_url):
        import warnings  # as `asyncrl train` warns

        warnings.warn("--redis_url with a password puts a secret on the command line, where every user sees it in "
                      "`ps`: set ASYNCRL_BUFFER__REDIS_URL instead (docs/security.md)", stacklevel=2)
    if not args.redis_url:
        print("asyncrl buffer: --redis_url is required (or set ASYNCRL_BUFFER__REDIS_URL)", file=sys.stderr)
        return 2
    from redis.exceptions import RedisError

    try:
        return asyncio.run(_amain(args))
    except (OSError, RedisError) as exc:
        from asyncrl.core.secret_values import redact_url

        print(f"asyncrl buffer: cannot reach {redact_url(args.redis_url)}: {_redact(str(exc), args.redis_url)}",
              file=sys.stderr)
        return 1
