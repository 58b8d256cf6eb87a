#!/usr/bin/env bash
# Start PostgreSQL, Redis and RabbitMQ on this machine when they are not running.
# Used by the test command; the platform itself needs none of them by default.
set -uo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {
  for _ in $(seq 1 60); do port_open "$1" && return 0; sleep 1; done
  echo "services.sh: nothing answers on 127.0.0.1:$1 ($2)" >&2
  return 1
}

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
exit 0
