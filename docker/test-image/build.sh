#!/usr/bin/env bash
# Builds, offline, the image the container end-to-end tests run, and prints its reference.
#
# No registry is reachable from CI, so nothing can be pulled: the image is imported from a root
# filesystem assembled here from files already on this machine:
#   - the muster binary under test, at /usr/local/bin/muster (the ENTRYPOINT, as in docker/Dockerfile);
#   - /bin/sh and the few coreutils the tests use;
#   - every system shared library (found with ldd) that muster, those tools, the Python interpreter
#     of the PyTorch virtualenv and every extension module of that virtualenv need, plus ld-linux.
# The interpreter's installation and the virtualenv themselves (~5 GB) are NOT copied: the tests
# bind-mount them read-only at the same absolute paths, so the venv's symlinks and RPATHs resolve
# inside the container exactly as on the host.
#
# The tag is the sha256 of the (reproducible) rootfs tarball, so a new muster binary or a changed
# library set gives a new image and an unchanged one is reused. Takes a few seconds.
#
#   IMAGE=$(docker/test-image/build.sh [MUSTER_BIN] [TORCH_PYTHON])   # stdout: muster-test:<hash>
set -euo pipefail

MUSTER_BIN=${1:-${MUSTER_BIN:-}}
TORCH_PYTHON=${2:-${MUSTER_TORCH_PYTHON:-}}
REPO_NAME=${MUSTER_TEST_IMAGE_REPO:-muster-test}
CACHE_ROOT="${MUSTER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/muster}"
# Tools a test may run inside a container besides muster and python (sh is always included).
TOOLS=(sleep cat env ls true kill)

log() { echo "test-image: $*" >&2; }
die() { log "$*"; exit 1; }

[[ -n "$MUSTER_BIN" && -x "$MUSTER_BIN" ]] || die "usage: $0 MUSTER_BIN [TORCH_PYTHON] (muster binary not executable: '${MUSTER_BIN}')"
command -v docker >/dev/null || die "docker CLI not found"
command -v ldd >/dev/null || die "ldd not found"

MUSTER_BIN=$(readlink -f "$MUSTER_BIN")
# Directories whose ELF files need their libraries collected. The venv and the interpreter's
# prefix are mounted at run time, so libraries that resolve inside them are not copied.
scan_dirs=()
mounted=()
if [[ -n "$TORCH_PYTHON" ]]; then
  [[ -x "$TORCH_PYTHON" ]] || die "python not executable: $TORCH_PYTHON"
  read -r venv base < <("$TORCH_PYTHON" -c 'import sys; print(sys.prefix, sys.base_prefix)') ||
    die "cannot ask $TORCH_PYTHON for its prefixes"
  scan_dirs+=("$venv" "$base")
  mounted+=("$venv" "$base")
fi

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.test-image.lock"
flock 9
work=$(mktemp -d "$CACHE_ROOT/test-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"

# Debian's merged /usr layout, so a library found at /lib/... or /usr/lib/... lands in one place.
mkdir -p "$root"/usr/{bin,lib,lib64,local/bin} "$root"/{etc,tmp,root,proc,sys,dev,run,var/tmp}
ln -s usr/bin "$root/bin"
ln -s usr/lib "$root/lib"
ln -s usr/lib64 "$root/lib64"
ln -s usr/bin "$root/sbin"
chmod 1777 "$root/tmp" "$root/var/tmp"

install -m 0755 "$MUSTER_BIN" "$root/usr/local/bin/muster"
elves=("$MUSTER_BIN")
install -m 0755 "$(readlink -f /bin/sh)" "$root/usr/bin/sh"
elves+=("$(readlink -f /bin/sh)")
for t in "${TOOLS[@]}"; do
  p=$(type -P "$t" 2>/dev/null || true)
  [[ "$p" == /* ]] || { log "skipping $t (not a binary here)"; continue; }
  install -m 0755 "$(readlink -f "$p")" "$root/usr/bin/$t"
  elves+=("$(readlink -f "$p")")
done

is_mounted() {
  local f=$1 m
  for m in "${mounted[@]}"; do [[ "$f" == "$m"/* ]] && return 0; done
  return 1
}

# ldd prints the whole closure: "libx.so => /path (addr)" and "/lib64/ld-linux... (addr)".
libs_of() {
  # ldd fails on the scripts and data files in the list; only its output matters.
  { xargs -0 ldd 2>/dev/null || true; } | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | sort -u
}
{
  printf '%s\0' "${elves[@]}"
  for d in "${scan_dirs[@]}"; do
    find "$d" -type f \( -name '*.so' -o -name '*.so.*' -o -perm -u+x \) -print0 2>/dev/null
  done
} | libs_of >"$work/libs"

n=0
while read -r lib; do
  is_mounted "$lib" && continue
  [[ -e "$lib" ]] || continue
  mkdir -p "$root$(dirname "$lib")"
  [[ -e "$root$lib" ]] || cp -L "$lib" "$root$lib"
  n=$((n + 1))
done <"$work/libs"
# The dynamic loader at its canonical path, whatever ldd called it.
if [[ -e /lib64/ld-linux-x86-64.so.2 && ! -e "$root/lib64/ld-linux-x86-64.so.2" ]]; then
  cp -L /lib64/ld-linux-x86-64.so.2 "$root/lib64/"
fi

# Mount points of the Python installation, so read-only bind mounts need not create them.
for m in "${mounted[@]}"; do mkdir -p "$root$m"; done

cat >"$root/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/sh
PASSWD
cat >"$root/etc/group" <<'GROUP'
root:x:0:
nogroup:x:65534:
GROUP
# Name lookups as in a pod: /etc/hosts first, then the cluster DNS (Docker's embedded resolver).
echo 'hosts: files dns' >"$root/etc/nsswitch.conf"

# Reproducible tarball: same inputs, same bytes, same tag.
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$root" -cf "$work/rootfs.tar" .
hash=$(sha256sum "$work/rootfs.tar" | cut -c1-16)
image="$REPO_NAME:$hash"

if docker image inspect "$image" >/dev/null 2>&1; then
  log "reusing $image"
else
  log "importing $image ($n libraries, $(du -sh "$work/rootfs.tar" | cut -f1))"
  # The same runtime contract as docker/Dockerfile: muster is PID 1, SIGTERM stops it. (`docker
  # import` on Engine 20.10 rejects STOPSIGNAL; SIGTERM is the engine's default stop signal.)
  docker import \
    --change 'ENTRYPOINT ["/usr/local/bin/muster"]' \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
    --change 'WORKDIR /' \
    --change 'LABEL io.muster.test-image=1' \
    "$work/rootfs.tar" "$image" >/dev/null
fi
echo "$image"
