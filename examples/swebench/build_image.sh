#!/usr/bin/env bash
# The SWE-bench example's container image, built offline from Debian packages (no
# registry pull): bash, git, patch, python3 and python3-pytest with their dependency
# closure, unpacked into one root filesystem and imported into podman.
#
#   examples/swebench/build_image.sh          # builds polar-swebench:latest unless present
#   POLAR_SWEBENCH_IMAGE=name:tag examples/swebench/build_image.sh --force
#
# Needs podman (`just setup`) and apt's package lists (apt-get download fetches the .debs
# from the configured mirror or a local one). Progress on stderr; the image name on stdout.
set -euo pipefail

IMAGE="${POLAR_SWEBENCH_IMAGE:-polar-swebench:latest}"
export CONTAINERS_CONF="${CONTAINERS_CONF:-${POLAR_PODMAN_DIR:-/tmp/polar-podman}/containers.conf}"
PACKAGES=(bash coreutils python3 python3-pytest git patch sed grep findutils diffutils)

log() { echo "swebench-image: $*" >&2; }

if [ "${1:-}" != "--force" ] && podman image exists "$IMAGE"; then
  log "image $IMAGE exists"
  echo "$IMAGE"
  exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs" "$work/root"
# the closure: every package the named ones depend on (recommends and suggests left out)
mapfile -t closure < <(apt-cache depends --recurse --no-recommends --no-suggests \
  --no-conflicts --no-breaks --no-replaces --no-enhances "${PACKAGES[@]}" |
  grep -E '^[a-z0-9]' | sort -u)
log "downloading ${#closure[@]} packages"
(cd "$work/debs" && apt-get download "${closure[@]}" >&2 2>"$work/download.log") || {
  apt-get update -qq >&2
  (cd "$work/debs" && apt-get download "${closure[@]}" >&2)
}
for deb in "$work"/debs/*.deb; do
  dpkg-deb -x "$deb" "$work/root"
done
root="$work/root"
# Debian 12's packages unpack into /bin and /usr/bin both (dpkg's usrmerge links are
# made by a maintainer script, which dpkg-deb -x does not run); sh is dash's, not here
for d in sbin lib lib64; do
  if [ -d "$root/usr/$d" ] && [ ! -e "$root/$d" ]; then ln -s "usr/$d" "$root/$d"; fi
done
ln -sf bash "$root/bin/sh"
mkdir -p "$root"/{etc,tmp,root,workspace,proc,sys,dev,testbed}
chmod 1777 "$root/tmp"
printf 'root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/:/bin/sh\n' >"$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
tar -C "$root" -cf "$work/rootfs.tar" .
log "importing $IMAGE ($(du -sh "$work/rootfs.tar" | cut -f1))"
podman import --change 'CMD ["/bin/bash"]' \
  --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin' \
  --change 'ENV LANG=C.UTF-8' \
  "$work/rootfs.tar" "$IMAGE" >&2
podman run --rm "$IMAGE" sh -c 'python3 -m pytest --version && git --version' >&2
echo "$IMAGE"
