#!/usr/bin/env bash
# Podman serving the Docker API on a Unix socket, plus an offline test image.
#
#   eval "$(infra/podman/setup.sh)"     # sets DOCKER_HOST for docker-py
#
# Idempotent: installs podman + runc if missing (apt), writes containers.conf (runc as OCI
# runtime and cgroupfs as cgroup manager: crun fails on these machines' cgroups; default
# ulimits lowered to 1024), starts `podman system service` unless it already answers, and
# builds `polar-test:latest` from busybox-static's .deb unless it exists. Only the final
# `export` line goes to stdout; progress goes to stderr.
set -euo pipefail

STATE_DIR="$(realpath -m "${POLAR_PODMAN_DIR:-/tmp/polar-podman}")"
SOCKET="$STATE_DIR/podman.sock"
IMAGE="${POLAR_TEST_IMAGE:-polar-test:latest}"
export CONTAINERS_CONF="$STATE_DIR/containers.conf"

log() { echo "podman-setup: $*" >&2; }

install_packages() {
  local missing=()
  command -v podman >/dev/null || missing+=(podman)
  command -v runc >/dev/null || missing+=(runc)
  [ ${#missing[@]} -eq 0 ] && return
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq "${missing[@]}" >&2
}

write_config() {
  mkdir -p "$STATE_DIR"
  cat >"$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
}

service_answers() {
  podman --url "unix://$SOCKET" version >/dev/null 2>&1
}

start_service() {
  if service_answers; then
    log "service already answers on $SOCKET"
    return
  fi
  rm -f "$SOCKET"
  log "starting podman system service on $SOCKET"
  # From / and in its own session: the service outlives this script and must not hold
  # the caller's directory (a clone that may be deleted) as its working directory.
  (cd / && exec setsid podman system service --time=0 "unix://$SOCKET" \
    >"$STATE_DIR/service.log" 2>&1 </dev/null) &
  echo $! >"$STATE_DIR/service.pid"
  for _ in $(seq 100); do
    service_answers && return
    sleep 0.1
  done
  log "service did not come up; see $STATE_DIR/service.log"
  exit 1
}

build_image() {
  if podman image exists "$IMAGE"; then
    log "image $IMAGE exists"
    return
  fi
  log "building $IMAGE from busybox-static"
  local work
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' RETURN
  (cd "$work" && { apt-get download busybox-static >&2 2>/dev/null ||
    { apt-get update -qq >&2 && apt-get download busybox-static >&2; }; })
  mkdir -p "$work/root"
  dpkg-deb -x "$work"/busybox-static_*.deb "$work/root"
  local bb="$work/root/bin/busybox"
  for applet in $("$bb" --list); do
    [ -e "$work/root/bin/$applet" ] || ln -s busybox "$work/root/bin/$applet"
  done
  mkdir -p "$work/root"/{etc,tmp,root,workspace,proc,sys,dev}
  chmod 1777 "$work/root/tmp"
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n' \
    >"$work/root/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$work/root/etc/group"
  tar -C "$work/root" -cf "$work/rootfs.tar" .
  podman import --change 'CMD ["/bin/sh"]' \
    --change 'ENV PATH=/bin:/usr/bin:/sbin:/usr/sbin' \
    "$work/rootfs.tar" "$IMAGE" >&2
}

install_packages
write_config
start_service
build_image
echo "export DOCKER_HOST=unix://$SOCKET"
