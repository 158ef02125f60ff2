#!/bin/bash
# Run another architecture's binaries on this host through QEMU user-mode emulation (binfmt_misc), for building
# and proving an image for that architecture (scripts/apptainer/make-base-image.sh --arch, bench/arm64_image.sh).
#
#   scripts/apptainer/emulation.sh on ARCH      register QEMU for ARCH (arm64, ppc64le, ...), saying what it changes
#   scripts/apptainer/emulation.sh off ARCH     undo what `on` changed, and only that
#   scripts/apptainer/emulation.sh status ARCH  exit 0 when ARCH's binaries run here (natively or emulated)
#
# `on` installs Debian's qemu-user-static on the host if missing, mounts binfmt_misc on /proc/sys/fs/binfmt_misc if
# it is not mounted, and registers the handler Debian ships for ARCH (its `F` flag opens the interpreter once, so
# chroots and containers, which do not have it, run ARCH binaries too). What it changed is written to
# $SCALELM_CACHE_DIR/emulation-ARCH, which `off` reads: a handler or mount that was there before stays.
# Environment: SCALELM_CACHE_DIR, SCALELM_BINFMT_DIR (default /proc/sys/fs/binfmt_misc).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"

[[ $# -eq 2 ]] || die "usage: $0 on|off|status ARCH"
action=$1 arch=$2
qemu=$(qemu_name "$arch") || die "no QEMU user-mode emulation known for architecture $arch"
binfmt=${SCALELM_BINFMT_DIR:-/proc/sys/fs/binfmt_misc}   # another: the tests' stand-in
handler="$binfmt/qemu-$qemu"
record="$SCALELM_CACHE_DIR/emulation-$arch"

case "$action" in
    status)
        [[ "$arch" == "$(host_arch)" ]] && exit 0
        [[ -f "$handler" ]] && head -n1 "$handler" | grep -qx enabled
        ;;
    on)
        need_root
        [[ "$arch" == "$(host_arch)" ]] && { log "$arch is this host's architecture: nothing to emulate"; exit 0; }
        ensure_host_pkg "qemu-$qemu-static" qemu-user-static
        mkdir -p "$SCALELM_CACHE_DIR"
        : > "$record.new"
        if ! mountpoint -q "$binfmt"; then
            mount -t binfmt_misc binfmt_misc "$binfmt"
            echo mounted >> "$record.new"
            log "mounted binfmt_misc on $binfmt"
        fi
        if [[ ! -f "$handler" ]]; then
            conf=/usr/lib/binfmt.d/qemu-$qemu.conf
            [[ -f "$conf" ]] || die "qemu-user-static has no $conf"
            grep -v '^#' "$conf" > "$binfmt/register"
            echo registered >> "$record.new"
            log "registered $handler (interpreter $(sed -n 's/^interpreter //p' "$handler"))"
        elif ! head -n1 "$handler" | grep -qx enabled; then
            echo 1 > "$handler"
            echo enabled >> "$record.new"
            log "enabled $handler"
        fi
        # a second `on` keeps what the first one did, so that one `off` undoes it all
        cat "$record.new" >> "$record" && rm -f "$record.new"
        grep -q '^flags:.*F' "$handler" \
            || log "warning: $handler lacks the F flag: a chroot or container will not find its interpreter"
        ;;
    off)
        need_root
        [[ -f "$record" ]] || { log "emulation of $arch was not turned on by this script: nothing to undo"; exit 0; }
        if grep -qx registered "$record" && [[ -f "$handler" ]]; then
            echo -1 > "$handler"; log "unregistered $handler"
        elif grep -qx enabled "$record" && [[ -f "$handler" ]]; then
            echo 0 > "$handler"; log "disabled $handler again"
        fi
        if grep -qx mounted "$record" && mountpoint -q "$binfmt" && [[ -z "$(ls "$binfmt" | grep -v -x -e register -e status)" ]]; then
            umount "$binfmt"; log "unmounted $binfmt"
        fi
        rm -f "$record"
        ;;
    *) die "unknown action $action: on, off or status" ;;
esac
