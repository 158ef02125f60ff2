#!/bin/bash
# Set up a real Apptainer runtime on a Debian bookworm host (run as root; idempotent).
#
#   .ci/apptainer/setup.sh [--rebuild] [--force]
#
# 1. Bootstraps a Debian sid minbase root filesystem with apptainer, squashfuse, fuse2fs, e2fsprogs
#    (and gocryptfs, which only silences an INFO line) into $SCALELM_APPTAINER_ROOT
#    (default /var/cache/scalelm/apptainer-root). Uses mmdebstrap (one apt run, parallel downloads:
#    about 20 s instead of several minutes with debootstrap + apt-get); .debs are kept in
#    $SCALELM_CACHE_DIR/debs-sid so a rebuild does not download them again. A ready rootfs is reused as is.
# 2. Writes root:200000:65536 to the rootfs's /etc/subuid and /etc/subgid, and regular-file
#    /etc/hosts and /etc/resolv.conf (bind-mounted from the host on each call).
# 3. Installs the wrappers `apptainer` and `singularity` into $SCALELM_APPTAINER_BINDIR (default /usr/local/bin);
#    see .ci/apptainer/wrapper.sh for what each call does.
#
# Options: --rebuild  rebuild the rootfs even when a ready one exists
#          --force    overwrite an `apptainer`/`singularity` in the bin dir that is not one of our wrappers
# Environment: SCALELM_CACHE_DIR, SCALELM_APPTAINER_ROOT, SCALELM_APPTAINER_BINDIR, SCALELM_DEBIAN_MIRROR.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"

rebuild=0 force=0
for a in "$@"; do
    case "$a" in
        --rebuild) rebuild=1 ;;
        --force) force=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option: $a" ;;
    esac
done
need_root

mkdir -p "$SCALELM_CACHE_DIR"
exec 9> "$SCALELM_CACHE_DIR/.setup.lock"
flock 9   # one setup at a time (parallel CI jobs)

ROOT="$SCALELM_APPTAINER_ROOT"
SUITE=sid
PACKAGES="apptainer,squashfuse,fuse2fs,e2fsprogs,gocryptfs"
STAMP_TEXT="suite=$SUITE packages=$PACKAGES"
STAMP="$ROOT/.scalelm-apptainer-ready"
t0=$SECONDS

if [[ $rebuild -eq 0 && -x "$ROOT/usr/bin/apptainer" && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]]; then
    log "reusing the Apptainer rootfs at $ROOT"
else
    ensure_host_pkg mmdebstrap mmdebstrap
    mirror="$(debian_mirror)"
    mkdir -p "$(dirname "$ROOT")"
    tmp="$ROOT.new"
    rm -rf "$tmp"
    mapfile -t opts < <(mmdebstrap_opts "$SCALELM_CACHE_DIR/debs-$SUITE")
    log "bootstrapping Debian $SUITE + $PACKAGES from $mirror into $ROOT"
    mmdebstrap --quiet "${opts[@]}" --include="$PACKAGES" "$SUITE" "$tmp" "$mirror" \
        || { rm -rf "$tmp"; die "mmdebstrap failed"; }
    rm -rf "$ROOT"
    mv "$tmp" "$ROOT"
    log "rootfs ready in $((SECONDS - t0)) s ($(du -sh "$ROOT" | cut -f1))"
fi

# Cheap configuration, redone on every run.
printf 'root:%s:%s\n' "$SCALELM_SUBID_START" "$SCALELM_SUBID_COUNT" > "$ROOT/etc/subuid"
cp "$ROOT/etc/subuid" "$ROOT/etc/subgid"
for f in /etc/hosts /etc/resolv.conf; do
    # bind-mount targets: must be regular files (not links) in the rootfs
    if [[ -L "$ROOT$f" || ! -f "$ROOT$f" ]]; then rm -f "$ROOT$f"; : > "$ROOT$f"; fi
    [[ -s "$ROOT$f" ]] || cat "$f" > "$ROOT$f" 2>/dev/null || echo '127.0.0.1 localhost' > "$ROOT$f"
done
mkdir -p "$ROOT/.oldroot"
echo "$STAMP_TEXT" > "$STAMP"

# Wrappers.
mkdir -p "$SCALELM_APPTAINER_BINDIR"
for tool in apptainer singularity; do
    dest="$SCALELM_APPTAINER_BINDIR/$tool"
    if [[ -e "$dest" ]] && ! grep -q "$WRAPPER_MARK" "$dest" 2>/dev/null && [[ $force -eq 0 ]]; then
        die "$dest exists and is not a scalelm wrapper (use --force to replace it)"
    fi
    sed -e "s|@ROOT@|$ROOT|g" -e "s|@TOOL@|$tool|g" "$here/wrapper.sh" > "$dest.tmp.$$"
    chmod 755 "$dest.tmp.$$"
    mv -f "$dest.tmp.$$" "$dest"
done

version="$("$SCALELM_APPTAINER_BINDIR/apptainer" --version)" || die "the wrapper does not work"
log "$version via $SCALELM_APPTAINER_BINDIR/apptainer and $SCALELM_APPTAINER_BINDIR/singularity (rootfs $ROOT); setup took $((SECONDS - t0)) s"
echo "$SCALELM_APPTAINER_BINDIR"
