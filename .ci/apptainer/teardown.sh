#!/bin/bash
# Undo .ci/apptainer/setup.sh (run as root).
#
#   .ci/apptainer/teardown.sh           remove the `apptainer`/`singularity` wrappers (only ours)
#   .ci/apptainer/teardown.sh --purge   also delete the rootfs and every cache under $SCALELM_CACHE_DIR
#                                           that these scripts made (.deb caches, base-image cache, wheelhouse);
#                                           emulation (emulation.sh) is undone by `emulation.sh off ARCH`
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"

purge=0
for a in "$@"; do
    case "$a" in
        --purge) purge=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option: $a" ;;
    esac
done
need_root

for tool in apptainer singularity; do
    f="$SCALELM_APPTAINER_BINDIR/$tool"
    if [[ -f "$f" ]] && grep -q "$WRAPPER_MARK" "$f"; then rm -f "$f"; log "removed $f"; fi
done

if [[ $purge -eq 1 ]]; then
    # The wrappers mount only inside private namespaces, but refuse to delete through a live mount.
    for d in "$SCALELM_APPTAINER_ROOT" "$SCALELM_APPTAINER_ROOT.new" "$SCALELM_CACHE_DIR"/base-build.*; do
        [[ -e "$d" ]] || continue
        if findmnt -rn -o TARGET | grep -q "^$d\(/\|$\)"; then die "something is mounted under $d"; fi
        rm -rf "$d"; log "removed $d"
    done
    # (-ARCH: another architecture's, make-base-image.sh --arch)
    for d in debs-sid debs-bookworm wheelhouse base-images debs-bookworm-* wheelhouse-* wheels-*; do
        [[ -e "$SCALELM_CACHE_DIR/$d" ]] && { rm -rf "${SCALELM_CACHE_DIR:?}/$d"; log "removed $SCALELM_CACHE_DIR/$d"; }
    done
    rmdir "$SCALELM_CACHE_DIR" 2>/dev/null || true
fi
