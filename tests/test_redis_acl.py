"""Least privilege in Redis (issue #18 item 7): one ACL user per role, real redis-server.

Each role runs its whole part of the buffer protocol with its own credentials; a rollout
worker's credentials are refused on the trainer's operations (batches, the clock), on other
runs' keys and on admin commands (CONFIG, FLUSHALL, SCRIPT FLUSH, DEBUG, ACL, KEYS), and a
refused call changes nothing. Read-only key patterns need Redis >= 7.0 (ACL selectors).
"""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from asyncrl.controller.redis_acl import ROLES, acl_file_text, acl_rules
from asyncrl.controller.redis_server import RedisServer, _redis_version, find_redis_binary
from buffers import NotPermitted, ReplayBuffer, UnknownItem
from test_buffer import feed, gen, settings

RUN = "t"


@pytest.fixture
def acl_server(tmp_path):
    binary = find_redis_binary()
    if _redis_version(binary) < (7, 0):
        pytest.skip("read-only ACL key patterns need redis-server >= 7.0 (Debian's redis-server package)")
    server = RedisServer(tmp_path / "redis", role_users=True, run=RUN, binary=binary).start()
    try:
        yield server
    finally:
        server.kill()


def test_acl_file_holds_hashes_not_passwords():
    text = acl_file_text("admin-pw-0123456789", {"rollout": "rollout-pw-0123456789"}, run=RUN)
    assert "admin-pw" not in text and "rollout-pw" not in text and "#" in text
    rules = acl_rules("rollout", RUN)
    assert "+config" not in rules and "+flushall" not in rules and "batch" not in rules
    assert "%R~asyncrl:{t}:version" in rules
    assert "%R~" not in acl_rules("rollout", RUN, selectors=False)
    with pytest.raises(ValueError):
        acl_rules("nobody")


async def test_roles_run_the_protocol_with_their_own_credentials(acl_server):
    s = settings()
    with pytest.raises(UnknownItem, match="may not create it"):
        await ReplayBuffer.open(acl_server.url_for("rollout"), RUN, s)  # the run does not exist yet
    feeder = await ReplayBuffer.open(acl_server.url_for("feeder"), RUN, s)
    rollout = await ReplayBuffer.open(acl_server.url_for("rollout"), RUN, s)
    trainer = await ReplayBuffer.open(acl_server.url_for("trainer"), RUN, s)
    try:
        await feed(feeder, 2)
        assert await feeder.pending_groups() >= 0
        while True:
            items = await rollout.claim("w", 8)
            if not items:
                break
            for it in items:
                await gen(rollout, it, 2, 0, "stop")
                await rollout.score(it, reward=1.0)
        assert await rollout.clock.latest() is None
        batch = await trainer.wait_batch(1, timeout_seconds=10)
        assert await trainer.acknowledge(batch, 1)
        await trainer.commit(1)
        await trainer.clock.publish(1, "/w/1", "sha256:0")
        assert (await rollout.clock.latest()).version == 1
        await trainer.recover(1, 1)
    finally:
        for b in (feeder, rollout, trainer):
            await b.close()


async def test_rollout_credentials_are_refused_on_trainer_operations_and_admin_commands(acl_server):
    s = settings()
    admin = await ReplayBuffer.open(acl_server.url, RUN, s)
    rollout = await ReplayBuffer.open(acl_server.url_for("rollout"), RUN, s)
    raw = aioredis.Redis.from_url(acl_server.url_for("rollout"))
    try:
        await feed(admin, 2)
        while items := await rollout.claim("w", 8):
            for it in items:
                await gen(rollout, it, 2, 0, "stop")
                await rollout.score(it, reward=1.0)
        before = {k: await admin.redis.dump(k) for k in await admin.redis.keys("*")}
        with pytest.raises(NotPermitted):
            await rollout.next_batch(1)  # the trainer's batch keys
        with pytest.raises(NotPermitted):
            await rollout.clock.publish(5, "/evil", "sha256:0")  # the clock
        with pytest.raises(NotPermitted):
            await rollout.recover(0, 0)
        with pytest.raises(NotPermitted):
            await rollout.commit(1)
        after = {k: await admin.redis.dump(k) for k in await admin.redis.keys("*")}
        assert after == before, "a refused call changed the buffer"
        p = rollout.prefix
        assert await raw.get(p + "version") is None  # the clock is readable...
        for call in (lambda: raw.set(p + "version", 99),  # ...but not writable
                     lambda: raw.hset(p + "weights:latest", "uri", "/evil"),
                     lambda: raw.get(p + "batch:open"),
                     lambda: raw.hgetall(p + "batch:1"),
                     lambda: raw.get("asyncrl:{other}:version"),  # another run's keys
                     lambda: raw.config_set("appendonly", "no"),
                     lambda: raw.config_get("requirepass"),
                     lambda: raw.flushall(),
                     lambda: raw.script_flush(),
                     lambda: raw.execute_command("DEBUG", "SLEEP", "0"),
                     lambda: raw.execute_command("ACL", "LIST"),
                     lambda: raw.keys("*"),
                     lambda: raw.execute_command("EVAL", "return redis.call('SET', KEYS[1], 1)", 1, p + "version")):
            with pytest.raises((NoPermissionError, ResponseError)) as exc:
                await call()
            assert any(w in str(exc.value) for w in ("NOPERM", "permission", "can't access", "not allowed"))
        assert await admin.clock.version() == 0 and await admin.redis.config_get("appendonly") in ({b"appendonly": b"yes"}, {"appendonly": "yes"})
    finally:
        await raw.aclose()
        await rollout.close()
        await admin.close()


@pytest.mark.parametrize("role", ROLES)
def test_no_role_may_run_admin_commands(acl_server, role):
    client = redis.Redis.from_url(acl_server.url_for(role))
    try:
        assert client.ping()
        for call in (lambda: client.config_set("appendonly", "no"), client.flushall, client.flushdb,
                     client.script_flush, lambda: client.execute_command("SHUTDOWN", "NOSAVE"),
                     lambda: client.execute_command("MONITOR")):
            with pytest.raises(NoPermissionError):
                call()
    finally:
        client.close()
    assert redis.Redis.from_url(acl_server.url).config_get("appendonly") == {"appendonly": "yes"}


def test_single_password_config_still_works(tmp_path):
    """A server without role users (one admin URL, the pre-ACL setup) serves every role."""
    with RedisServer(tmp_path / "r") as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping() and client.config_get("appendonly") == {"appendonly": "yes"}
        with pytest.raises(KeyError):
            server.url_for("rollout")
