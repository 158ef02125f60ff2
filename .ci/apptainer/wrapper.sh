#!/bin/bash
# scalelm host-side Apptainer wrapper (installed as `apptainer` and `singularity` by
# .ci/apptainer/setup.sh; this file is the template).
#
# The real Apptainer (Debian sid package) lives in a sid root filesystem because it needs a newer
# glibc than the host has. Each call:
#   1. enters a private mount namespace (unshare --mount),
#   2. mounts proc, sys, a private /dev, and binds host directories at the same paths
#      (/work, /tmp, /var/tmp, /opt/wheels, $HOME, the current directory, $SCALELM_APPTAINER_BINDS, the directories of
#      absolute paths in the arguments; /etc/resolv.conf, /etc/hosts, /etc/ssl/certs),
#   3. pivot_root's into the rootfs, returns to the current directory,
#   4. execs the real runtime under `unshare -U -r --map-auto` (root here lacks CAP_SYS_RESOURCE, so
#      Apptainer must run as root of a user namespace; the extra subuid range lets builds chown files).
# argv (less --fakeroot, see below), stdin/stdout/stderr, the environment and the exit status pass through
# unchanged (all exec, no fork).
#
# Environment:
#   SCALELM_APPTAINER_ROOT   rootfs to use (default: the one setup.sh installed)
#   SCALELM_APPTAINER_BINDS  extra host paths (colon-separated) bound at the same path
#   SCALELM_APPTAINER_DEFAULT_BINDS  the machine's own directories bound at the same path (default
#                            /work:/tmp:/var/tmp:/opt/wheels: the test machine's)
#   SCALELM_APPTAINER_TOOL   program to run in the rootfs instead of the runtime (debugging, e.g. bash)
set -euo pipefail

ROOT="${SCALELM_APPTAINER_ROOT:-@ROOT@}"
TOOL="${SCALELM_APPTAINER_TOOL:-@TOOL@}"   # override only for debugging (e.g. bash)
# the test machine's own directories (its work tree, temporary files, wheel cache), bound at the same path
DEFAULT_BINDS="${SCALELM_APPTAINER_DEFAULT_BINDS:-/work:/tmp:/var/tmp:/opt/wheels}"

die() { echo "scalelm-apptainer-wrapper: $*" >&2; exit 255; }

if [[ "${_SCALELM_APPTAINER_STAGE:-}" != inner ]]; then
    [[ $(id -u) -eq 0 ]] || die "must run as root (it sets up mount namespaces); see .ci/apptainer/setup.sh"
    [[ -x "$ROOT/usr/bin/apptainer" && -e "$ROOT/.scalelm-apptainer-ready" ]] \
        || die "no apptainer rootfs at $ROOT; run .ci/apptainer/setup.sh"
    self="$(readlink -f "${BASH_SOURCE[0]}")"
    export _SCALELM_APPTAINER_STAGE=inner
    exec /usr/bin/unshare --mount --propagation private -- /bin/bash "$self" "$@"
fi
unset _SCALELM_APPTAINER_STAGE

cwd="$(pwd -P 2>/dev/null || echo /)"
ROOT="$(readlink -f "$ROOT")"

mount --bind "$ROOT" "$ROOT"
# Host directories at the same paths: defaults, $HOME (as a native install would see it), $SCALELM_APPTAINER_BINDS, the working directory, then
# the directories of absolute paths named in the arguments or in APPTAINER_BIND/SINGULARITY_BIND (image
# paths, build outputs, --bind sources such as Snakemake's source cache under ~/.cache), so that they
# resolve as they would with a native install. System directories of the rootfs are never replaced.
bound=()
covered() {  # is $1 inside an already bound path?
    local b
    for b in "${bound[@]+"${bound[@]}"}"; do
        [[ "$1" == "$b" || "$1" == "$b"/* ]] && return 0
    done
    return 1
}
system_dir() {  # would binding $1 hide a part of the rootfs that the runtime needs?
    case "$1" in
        / | /var | /var/cache | /etc | /etc/* | /usr | /usr/* | /bin | /bin/* | /sbin | /sbin/* | /lib | /lib/* \
        | /lib32* | /lib64* | /libx32* | /proc | /proc/* | /sys | /sys/* | /dev | /dev/* | /run | /run/* \
        | /boot | /boot/* | /var/lib | /var/lib/* | /var/log | /var/log/* | /var/cache/apt* | /var/spool* ) return 0 ;;
    esac
    [[ "$ROOT" == "$1" || "$ROOT" == "$1"/* || "$1" == "$ROOT"/* ]]
}
bind_same_path() {
    local p="$1"
    [[ -n "$p" && -e "$p" ]] || return 0
    p="$(readlink -f "$p")"
    system_dir "$p" && return 0
    covered "$p" && return 0
    if [[ -d "$p" ]]; then
        mkdir -p "$ROOT$p"
    else
        mkdir -p "$(dirname "$ROOT$p")"; [[ -e "$ROOT$p" ]] || : > "$ROOT$p"
    fi
    mount --rbind "$p" "$ROOT$p"
    bound+=("$p")
}
arg_dirs() {  # directories to bind for one argument: "/a/b", "--opt=/a/b", "/src:/dst:ro,/src2"
    local spec item
    case "$1" in --*=/*) spec="${1#*=}" ;; /*) spec="$1" ;; *) return 0 ;; esac
    IFS=, read -r -a items <<< "$spec"
    for item in "${items[@]}"; do
        item="${item%%:*}"
        [[ "$item" == /* ]] || continue
        if [[ -d "$item" ]]; then echo "$item"
        elif [[ -d "$(dirname "$item")" ]]; then dirname "$item"   # files and not yet existing outputs
        fi
    done
}
IFS=: read -r -a extra <<< "${SCALELM_APPTAINER_BINDS:-}"
for p in ${DEFAULT_BINDS//:/ } "${HOME:-}" "${extra[@]+"${extra[@]}"}" "$cwd"; do bind_same_path "$p"; done
for a in "$@" "${APPTAINER_BIND:-}" "${SINGULARITY_BIND:-}"; do
    while IFS= read -r p; do bind_same_path "$p"; done < <(arg_dirs "$a")
done

mount -t proc -o nosuid,nodev,noexec proc "$ROOT/proc"
# Another architecture's programs run through the host's QEMU handlers (.ci/apptainer/emulation.sh), which
# apptainer looks for here before it builds or runs such an image: the one (init namespace's) registry, shown again
if mountpoint -q /proc/sys/fs/binfmt_misc; then mount -t binfmt_misc binfmt_misc "$ROOT/proc/sys/fs/binfmt_misc"; fi
mount --rbind /sys "$ROOT/sys"

# A private /dev with just what apptainer (and squashfuse) needs.
mount -t tmpfs -o nosuid,mode=0755,size=64k tmpfs "$ROOT/dev"
mkdev() { mknod -m "$1" "$ROOT/dev/$2" c "$3" "$4"; }
mkdev 666 null 1 3; mkdev 666 zero 1 5; mkdev 666 full 1 7
mkdev 666 random 1 8; mkdev 666 urandom 1 9; mkdev 666 tty 5 0
mkdev 666 fuse 10 229; mkdev 660 loop-control 10 237
for i in 0 1 2 3 4 5 6 7; do mknod -m 660 "$ROOT/dev/loop$i" b 7 "$i"; done
mkdir -m 755 "$ROOT/dev/pts" "$ROOT/dev/shm"
# The host's pseudo-terminals (so a terminal on stdin keeps its name: `tty`, ttyname()) and shared memory
# (shared by several calls, as on a native install), else private instances.
if mountpoint -q /dev/pts; then
    mount --bind /dev/pts "$ROOT/dev/pts"; mkdev 666 ptmx 5 2
else
    mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$ROOT/dev/pts"; ln -s pts/ptmx "$ROOT/dev/ptmx"
fi
if mountpoint -q /dev/shm; then mount --bind /dev/shm "$ROOT/dev/shm"
else mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$ROOT/dev/shm"; fi
ln -s /proc/self/fd "$ROOT/dev/fd"
ln -s /proc/self/fd/0 "$ROOT/dev/stdin"
ln -s /proc/self/fd/1 "$ROOT/dev/stdout"
ln -s /proc/self/fd/2 "$ROOT/dev/stderr"

# Name resolution and TLS trust (this site's CA certificates) from the host (targets made by setup.sh).
for f in /etc/resolv.conf /etc/hosts; do
    if [[ -f "$f" && -f "$ROOT$f" && ! -L "$ROOT$f" ]]; then mount --bind "$f" "$ROOT$f"; fi
done
if [[ -d /etc/ssl/certs && -d "$ROOT/etc/ssl/certs" ]]; then mount --bind /etc/ssl/certs "$ROOT/etc/ssl/certs"; fi

cd "$ROOT"
mkdir -p .oldroot
pivot_root . .oldroot
umount -l /.oldroot
cd "$cwd" 2>/dev/null || cd /

# The runtime already runs as root of a user namespace with a subordinate id range, which is what
# --fakeroot asks for; a nested fakeroot namespace fails here (newgidmap: Operation not permitted),
# so the long option (and its environment form) is dropped. The short form -f is left alone.
args=()
for a in "$@"; do [[ "$a" == --fakeroot ]] || args+=("$a"); done
unset APPTAINER_FAKEROOT SINGULARITY_FAKEROOT

export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}"
exec unshare --user --map-root-user --map-auto -- "$TOOL" "${args[@]+"${args[@]}"}"
