#!/bin/sh
# Container entry point: the first argument names the service, the rest are
# its flags (`learner --run-id r1 --metrics-addr 0.0.0.0:9100`).
set -eu
service="${1:-help}"
[ $# -gt 0 ] && shift
case "$service" in
  env-runner|inference-server|replay-buffer|learner|evaluator|tracker)
    exec "/usr/local/bin/relay-$service" "$@" ;;
  relay)
    exec /usr/local/bin/relay "$@" ;;
  help|-h|--help)
    echo "usage: <env-runner|inference-server|replay-buffer|learner|evaluator|tracker|relay> [flags]"
    exit 0 ;;
  *)
    echo "unknown service: $service (expected env-runner, inference-server, replay-buffer, learner, evaluator, tracker or relay)" >&2
    exit 64 ;;
esac
