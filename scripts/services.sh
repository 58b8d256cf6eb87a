#!/usr/bin/env bash
# Start PostgreSQL, Redis and RabbitMQ on this machine when they are not running, and give the
# test suite its own credentials on Redis and RabbitMQ, as production has: a Redis ACL user and
# a RabbitMQ user with a vhost of its own, both `harli-test`, with a password generated once per
# machine and kept (mode 0600) in $HARLI_TEST_SERVICES_ENV (default
# ${XDG_STATE_HOME:-~/.local/state}/harli/test-services.env), which the tests read
# (tests/services.py). Idempotent: run again, it keeps the password and only re-applies what a
# restarted server forgot (Redis ACL users live in memory). The servers' other users (Redis's
# `default`, RabbitMQ's `guest`) are left as they are, for whoever else uses this machine;
# nothing in the suite uses them.
# Used by the test command; the platform itself needs none of them by default.
set -uo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {
  for _ in $(seq 1 60); do port_open "$1" && return 0; sleep 1; done
  echo "services.sh: nothing answers on 127.0.0.1:$1 ($2)" >&2
  return 1
}

TEST_USER=harli-test
TEST_VHOST=harli-test
TEST_REDIS_DB=15
SERVICES_ENV="${HARLI_TEST_SERVICES_ENV:-${XDG_STATE_HOME:-$HOME/.local/state}/harli/test-services.env}"

if ! port_open 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
  wait_port 5432 PostgreSQL || exit 1
fi
if ! port_open 6379; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  wait_port 6379 Redis || exit 1
fi
if ! port_open 5672; then
  rabbitmq-server -detached
  wait_port 5672 RabbitMQ || exit 1
fi

# The suite's password: generated once, kept for every later run (and every worktree).
password=""
if [ -f "$SERVICES_ENV" ]; then
  password="$(sed -n 's/^HARLI_TEST_SERVICES_PASSWORD=//p' "$SERVICES_ENV")"
fi
if [ -z "$password" ]; then
  password="$(head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 32)"
  mkdir -p "$(dirname "$SERVICES_ENV")"
  (
    umask 077
    cat >"$SERVICES_ENV.tmp" <<EOF
# Written by scripts/services.sh: the test suite's own users on this machine's Redis and RabbitMQ.
HARLI_TEST_SERVICES_PASSWORD=$password
HARLI_TEST_REDIS_URL=redis://$TEST_USER:$password@127.0.0.1:6379/$TEST_REDIS_DB
HARLI_TEST_AMQP_URL=amqp://$TEST_USER:$password@127.0.0.1:5672/$TEST_VHOST
EOF
  ) && mv "$SERVICES_ENV.tmp" "$SERVICES_ENV" || exit 1
fi

# Redis: an ACL user with that password (the default user is untouched). `reset` first, so
# the user is exactly this whatever an earlier run or anyone else left.
# The password goes through the environment and stdin, never a command line.
# (WHOAMI, not PING: a failed AUTH leaves redis-cli connected as the default user.)
if ! REDISCLI_AUTH="$password" redis-cli -h 127.0.0.1 -p 6379 --user "$TEST_USER" ACL WHOAMI \
    2>/dev/null | grep -qx "$TEST_USER"; then
  reply="$(printf 'ACL SETUSER %s reset on >%s ~* &* +@all\n' "$TEST_USER" "$password" |
    redis-cli -h 127.0.0.1 -p 6379 2>&1)"
  if [ "$reply" != "OK" ]; then
    echo "services.sh: cannot add the Redis user $TEST_USER: $reply" >&2
    exit 1
  fi
fi

# RabbitMQ: a user and a vhost of the suite's own (guest is untouched).
rabbitmqctl -q await_startup >/dev/null 2>&1 || { echo "services.sh: RabbitMQ did not start" >&2; exit 1; }
if ! rabbitmqctl -q authenticate_user "$TEST_USER" "$password" >/dev/null 2>&1; then
  rabbitmqctl -q add_user "$TEST_USER" "$password" >/dev/null 2>&1 ||
    rabbitmqctl -q change_password "$TEST_USER" "$password" >/dev/null || {
      echo "services.sh: cannot add the RabbitMQ user $TEST_USER" >&2; exit 1; }
fi
if ! rabbitmqctl -q list_vhosts name 2>/dev/null | grep -qx "$TEST_VHOST"; then
  rabbitmqctl -q add_vhost "$TEST_VHOST" >/dev/null || exit 1
fi
rabbitmqctl -q set_permissions -p "$TEST_VHOST" "$TEST_USER" '.*' '.*' '.*' >/dev/null || exit 1
exit 0
