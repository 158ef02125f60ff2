# shellcheck shell=bash disable=SC2034,SC2016
# Shared settings for .ci/apptainer/*.sh (sourced, not executed).

SCALELM_CACHE_DIR="${SCALELM_CACHE_DIR:-/var/cache/scalelm}"
SCALELM_APPTAINER_ROOT="${SCALELM_APPTAINER_ROOT:-$SCALELM_CACHE_DIR/apptainer-root}"
SCALELM_APPTAINER_BINDIR="${SCALELM_APPTAINER_BINDIR:-/usr/local/bin}"
# the test machine's wheel cache, where the host's torch wheel lies (make-base-image.sh, the wrappers' binds)
SCALELM_WHEEL_CACHE="${SCALELM_WHEEL_CACHE:-/opt/wheels}"
# First subordinate id of root inside the rootfs (/etc/subuid, /etc/subgid). With
# `unshare -U -r --map-auto`, namespace id N (1..65536) is host id SUBID_START+N-1.
SCALELM_SUBID_START=200000
SCALELM_SUBID_COUNT=65536
WRAPPER_MARK="scalelm host-side Apptainer wrapper"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Architectures by Go's (SIF headers') name, from the package's one list of them (architecture, machine, Debian's).
ARCHITECTURES="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/src/scalelm/launch/architectures.tsv"
host_arch() {  # the architecture of this host's `uname -m`
    awk -F'\t' -v m="$(uname -m)" '!/^#/ && $2 == m {print $1; found=1} END {exit !found}' "$ARCHITECTURES"
}
qemu_name() {  # qemu_name ARCH: QEMU's (and `uname -m`'s) name of ARCH, given by Go's or Debian's name
    awk -F'\t' -v a="$1" '!/^#/ && ($1 == a || $3 == a) {print $2; found=1} END {exit !found}' "$ARCHITECTURES"
}

need_root() { [[ $(id -u) -eq 0 ]] || die "run as root (debootstrap, mount namespaces)"; }

# The Debian mirror the host's apt uses (deb822 or one-line sources), unless SCALELM_DEBIAN_MIRROR is set.
debian_mirror() {
    if [[ -n "${SCALELM_DEBIAN_MIRROR:-}" ]]; then echo "$SCALELM_DEBIAN_MIRROR"; return; fi
    local uri
    uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
          | awk 'tolower($1)=="uris:" {for (i=2;i<=NF;i++) print $i}' | grep -v security | grep '/debian/\?$' | head -n1 || true)
    if [[ -z "$uri" ]]; then
        uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
              | awk '$1=="deb" {for (i=2;i<=NF;i++) if ($i ~ /^(https?|file):/) {print $i; break}}' \
              | grep -v security | grep '/debian/\?$' | head -n1 || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

# Make sure a host tool from a Debian package is present (apt lists are refreshed only if needed).
ensure_host_pkg() {  # ensure_host_pkg COMMAND PACKAGE
    command -v "$1" >/dev/null 2>&1 && return 0
    log "installing $2 on the host (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    local apt=(apt-get -o DPkg::Lock::Timeout=300 -y -qq)
    "${apt[@]}" install --no-install-recommends "$2" >/dev/null 2>&1 \
        || { "${apt[@]}" update >/dev/null && "${apt[@]}" install --no-install-recommends "$2" >/dev/null; } \
        || die "cannot install $2 with apt-get"
}

# mmdebstrap options shared by the rootfs builds: minbase, no recommends, a frozen mirror snapshot is fine,
# no fsync (a crash only loses a cache), no docs/man/locales, and a persistent .deb cache (DIR) synced in before and out after the run.
mmdebstrap_opts() {  # mmdebstrap_opts DEB_CACHE_DIR
    local debs="$1"
    mkdir -p "$debs"
    printf '%s\n' \
        --variant=minbase \
        --aptopt='Acquire::Check-Valid-Until "false"' \
        --aptopt='APT::Install-Recommends "false"' \
        --dpkgopt='force-unsafe-io' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --skip=download/empty \
        --skip=essential/unlink \
        --setup-hook="mkdir -p \"\$1/var/cache/apt/archives/\"" \
        --setup-hook="sync-in '$debs' /var/cache/apt/archives/" \
        --customize-hook="sync-out /var/cache/apt/archives '$debs'" \
        --customize-hook='rm -f "$1"/var/cache/apt/archives/*.deb'
}
