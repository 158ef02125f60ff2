#!/bin/bash
# Run another architecture's binaries on this host through QEMU user-mode emulation (binfmt_misc), for building
# and proving an image for that architecture (.ci/apptainer/make-base-image.sh --arch, bench/arm64_image.sh).
#
#   .ci/apptainer/emulation.sh on ARCH      register QEMU for ARCH (arm64, ppc64le, ...), saying what it changes
#   .ci/apptainer/emulation.sh off ARCH     undo what `on` changed, and only that
#   .ci/apptainer/emulation.sh status ARCH  exit 0 when ARCH's binaries run here (natively or emulated)
#
# `on` installs Debian's qemu-user-static on the host if missing, mounts binfmt_misc on /proc/sys/fs/binfmt_misc if
# it is not mounted, and registers the handler Debian ships for ARCH (its `F` flag opens the interpreter once, so
# chroots and containers, which do not have it, run ARCH binaries too). What it changed is written as it changes it
# (so also by an `on` that fails later) to $SCALELM_CACHE_DIR/emulation-ARCH, and the mount, which every ARCH shares,
# to $SCALELM_CACHE_DIR/emulation-mount; `off` reads them: a handler or mount that was there before stays, and the
# mount goes with the last handler, whichever ARCH's `off` removes that. `off` again changes nothing.
# Environment: SCALELM_CACHE_DIR, SCALELM_BINFMT_DIR (default /proc/sys/fs/binfmt_misc), SCALELM_BINFMT_CONF_DIR
#   (qemu-user-static's handlers, default /usr/lib/binfmt.d).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"

[[ $# -eq 2 ]] || die "usage: $0 on|off|status ARCH"
action=$1 arch=$2
qemu=$(qemu_name "$arch") || die "no QEMU user-mode emulation known for architecture $arch"
binfmt=${SCALELM_BINFMT_DIR:-/proc/sys/fs/binfmt_misc}   # another: the tests' stand-in
conf_dir=${SCALELM_BINFMT_CONF_DIR:-/usr/lib/binfmt.d}
handler="$binfmt/qemu-$qemu"
record="$SCALELM_CACHE_DIR/emulation-$arch"
mount_record="$SCALELM_CACHE_DIR/emulation-mount"
# the handlers registered in binfmt_misc, by anyone
handlers() { find "$binfmt" -mindepth 1 -maxdepth 1 ! -name register ! -name status -printf '%f\n' | sort | xargs; }

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
        # each change is recorded as soon as it is made, so that `off` undoes it even if a later step fails; a
        # second `on` adds to the first's record, so that one `off` undoes both
        if ! mountpoint -q "$binfmt"; then
            mount -t binfmt_misc binfmt_misc "$binfmt"
            echo mounted > "$mount_record"
            log "mounted binfmt_misc on $binfmt"
        fi
        if [[ ! -f "$handler" ]]; then
            conf=$conf_dir/qemu-$qemu.conf
            [[ -f "$conf" ]] || die "qemu-user-static has no $conf: reinstall it (apt-get install --reinstall" \
                "qemu-user-static) and run this again; \`emulation.sh off $arch\` undoes what this did"
            grep -v '^#' "$conf" > "$binfmt/register" \
                || die "binfmt_misc refused the handler in $conf (see above): reinstall qemu-user-static and run" \
                       "this again; \`emulation.sh off $arch\` undoes what this did"
            echo registered >> "$record"
            log "registered $handler (interpreter $(sed -n 's/^interpreter //p' "$handler"))"
        elif ! head -n1 "$handler" | grep -qx enabled; then
            echo 1 > "$handler"
            echo enabled >> "$record"
            log "enabled $handler"
        fi
        grep -q '^flags:.*F' "$handler" \
            || log "warning: $handler lacks the F flag: a chroot or container will not find its interpreter"
        ;;
    off)
        need_root
        # what an earlier version recorded: the mount in the ARCH's record, a failed `on`'s changes in ARCH.new
        if [[ -f "$record.new" ]]; then cat "$record.new" >> "$record"; rm -f "$record.new"; fi
        if [[ -f "$record" ]] && grep -qx mounted "$record"; then echo mounted > "$mount_record"; fi
        if [[ ! -f "$record" && ! -f "$mount_record" ]]; then
            log "emulation of $arch was not turned on by this script: nothing to undo"; exit 0
        fi
        if [[ ! -f "$record" ]]; then
            log "emulation of $arch was not turned on by this script: nothing to undo for it"
        elif grep -qx registered "$record" && [[ -f "$handler" ]]; then
            echo -1 > "$handler"; log "unregistered $handler"
        elif grep -qx enabled "$record" && [[ -f "$handler" ]]; then
            echo 0 > "$handler"; log "disabled $handler again"
        fi
        rm -f "$record"
        if [[ -f "$mount_record" ]]; then
            if ! mountpoint -q "$binfmt"; then
                rm -f "$mount_record"   # unmounted since, by someone else
            elif others=$(handlers) && [[ -n "$others" ]]; then
                # unmounting would drop them (another ARCH's `on`, or someone else's): a later `off` unmounts it
                log "$binfmt stays mounted while it holds other handlers: $others (this script mounted it: the" \
                    "\`emulation.sh off\` that finds none left unmounts it)"
            else
                umount "$binfmt"; rm -f "$mount_record"; log "unmounted $binfmt"
            fi
        fi
        ;;
    *) die "unknown action $action: on, off or status" ;;
esac
