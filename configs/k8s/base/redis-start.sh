#!/bin/sh
# Start the run's redis-server with one ACL user per role (docs/security.md), no password on any
# command line: users.acl holds SHA-256 hashes of the passwords from the environment (Secret
# asyncrl-secrets: REDIS_PASSWORD for the admin `default` user, REDIS_<ROLE>_PASSWORD per role),
# the rules come from redis-acl.rules (`python -m asyncrl.controller.redis_acl`). Both files are 0600.
# Paths: ACL_RULES (default /etc/asyncrl-redis/redis-acl.rules), RUN_DIR (/run/redis), DATA_DIR (/data).
set -eu
umask 077
rules="${ACL_RULES:-/etc/asyncrl-redis/redis-acl.rules}"
run="${RUN_DIR:-/run/redis}"
data="${DATA_DIR:-/data}"
h() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
: "${REDIS_PASSWORD:?set REDIS_PASSWORD (Secret asyncrl-secrets, key redis-password)}"
acl="$run/users.acl"
echo "user default on #$(h "$REDIS_PASSWORD") ~* &* +@all" > "$acl"
grep -v '^#' "$rules" | while read -r role rules_of_role; do
  var="REDIS_$(echo "$role" | tr a-z A-Z)_PASSWORD"
  pw="$(printenv "$var")" || { echo "redis-start.sh: $var is not set (Secret asyncrl-secrets, key redis-$role-password)" >&2; exit 1; }
  echo "user $role on #$(h "$pw") $rules_of_role" >> "$acl"
done
printf '%s\n' "appendonly yes" "appendfsync everysec" "dir $data" "protected-mode no" "aclfile $acl" \
  ${REDIS_PORT:+"port $REDIS_PORT"} ${REDIS_BIND:+"bind $REDIS_BIND"} > "$run/redis.conf"
exec "${REDIS_SERVER:-redis-server}" "$run/redis.conf"
