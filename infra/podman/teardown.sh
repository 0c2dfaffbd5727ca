#!/usr/bin/env bash
# Stops the podman API service started by setup.sh (the image and storage stay).
set -euo pipefail

STATE_DIR="${POLAR_PODMAN_DIR:-/tmp/polar-podman}"
PID_FILE="$STATE_DIR/service.pid"

if [ -f "$PID_FILE" ]; then
  pid="$(cat "$PID_FILE")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$PID_FILE"
fi
rm -f "$STATE_DIR/podman.sock"
