#!/usr/bin/env bash
# What every node of a flatrl cluster runs; skypilot.yaml and slurm.sbatch only set the environment and
# call this (tests/test_scale.py runs it on one machine: two trainer "nodes" and a worker on loopback).
#   ROLE=trainer  this node's part of the trainer: torchrun, NNODES nodes x NPROC processes; global rank 0
#                 (on NODE_RANK 0, the node HEAD names) serves weights and takes rollouts on PORT
#   ROLE=rollout  one rollout worker, pulling weights from and pushing batches to http://HEAD:PORT
# Also: CONFIG (a preset), BIND (the trainer's listen address: 0.0.0.0 on a cluster, which needs a token on
# every node: TOKEN_FILE, a file holding it, read by flatrl alone; or FLATRL_TOKEN, which torchrun and this
# shell then hold in their environment too), RDZV_PORT; any arguments are passed on to train.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
fail() { echo "launch.sh: $*" >&2; exit 2; }  # each precondition: one line, before anything starts
[ "${ROLE:-}" = trainer ] || [ "${ROLE:-}" = rollout ] || fail "set ROLE=trainer or ROLE=rollout"
[ -n "${HEAD:-}" ] || fail "set HEAD to the first trainer node's host name or address (127.0.0.1 on one machine)"
[ -f "${CONFIG:-}" ] || fail "set CONFIG to a preset file, e.g. CONFIG=configs/arith_grpo_cpu.yaml (${CONFIG:-unset} is not a file)"
PORT=${PORT:-8000}
[[ "$PORT" =~ ^[0-9]+$ ]] || fail "PORT=$PORT is not a port number"
getent hosts "$HEAD" > /dev/null || fail "HEAD=$HEAD does not resolve to an address on this node"
case "${BIND:-0.0.0.0}" in
  127.*|localhost|::1) ;;
  *) [ "$ROLE" = rollout ] || [ -n "${FLATRL_TOKEN:-}" ] || [ -n "${TOKEN_FILE:-}" ] || fail "BIND=${BIND:-0.0.0.0} \
serves beyond this machine: set TOKEN_FILE or FLATRL_TOKEN (the same secret on every node), or BIND=127.0.0.1" ;;
esac
[ -z "${TOKEN_FILE:-}" ] || [ -r "$TOKEN_FILE" ] || fail "TOKEN_FILE=$TOKEN_FILE is not a readable file"
token=()
[ -z "${TOKEN_FILE:-}" ] || token=(--token-file "$TOKEN_FILE")
if [ "$ROLE" = trainer ]; then
  # Static rendezvous, not c10d: c10d numbers nodes by sorted host name, so global rank 0, the one that
  # serves HTTP, could land on any node; --node-rank 0 pins it to HEAD, where the workers look for it.
  exec torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${NPROC:-1}" \
    --master-addr "$HEAD" --master-port "${RDZV_PORT:-29500}" \
    train.py --config "$CONFIG" --role trainer --bind "${BIND:-0.0.0.0}" --port "$PORT" "${token[@]}" "$@"
fi
exec python train.py --config "$CONFIG" --role rollout --trainer-url "http://$HEAD:$PORT" "${token[@]}" "$@"
