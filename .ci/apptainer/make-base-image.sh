#!/bin/bash
# Make a local base image (stand-in for the CUDA PyTorch image, which cannot be pulled here):
# Debian bookworm minbase + python3 (3.11) + pip + venv + `python` + the local torch CPU wheel (+ numpy).
#
#   .ci/apptainer/make-base-image.sh [--rebuild] [--arch ARCH] OUT.sif
#   .ci/apptainer/make-base-image.sh [--arch ARCH] --download-only
#
# --arch: the image's architecture (Debian's name: amd64, arm64), default this host's. Another one is built under
# QEMU emulation (.ci/apptainer/emulation.sh on ARCH first) with that architecture's torch from PyPI
# (SCALELM_TORCH_VERSION, default 2.10.0: the newest CPU build PyPI has for aarch64; 2.11 on bundle CUDA 13, GBs a
# CPU stand-in does not use), its .debs, wheels and image cached apart (debs-bookworm-ARCH, wheelhouse-ARCH,
# base-images/base-ARCH-KEY.sif). --download-only: fetch torch and its wheels for ARCH into the caches and stop
# (no emulation, no Apptainer needed: for a build without PyPI later, so a download that fails is an error).
#
# Needs the wrappers from .ci/apptainer/setup.sh. Steps: mmdebstrap bookworm into a staging dir
# (.debs cached in $SCALELM_CACHE_DIR/debs-bookworm), torch's dependencies downloaded by the host's pip into
# $SCALELM_CACHE_DIR/wheelhouse, `pip install` of the wheel in a chroot (no network needed then),
# clean-up (empty /dev: device nodes break `Bootstrap: localimage` under a user namespace; ownership
# shifted into the wrapper's subuid range so the image keeps it), then `apptainer build OUT.sif DIR`.
# The result is cached in $SCALELM_CACHE_DIR/base-images/ keyed by the inputs; a hit is a plain copy.
#
# Environment: SCALELM_TORCH_WHEEL (default: the torch 2.13.0 CPU wheel in $SCALELM_WHEEL_CACHE, /opt/wheels; another architecture's
#   is downloaded to $SCALELM_CACHE_DIR/wheels-ARCH),
#   SCALELM_BASE_PIP_EXTRA (default "numpy"), SCALELM_EXTRA_CA_DIR (host CA certificates added to the image,
#   default /usr/local/share/ca-certificates: this machine's TLS-intercepting proxy), SCALELM_MKSQUASHFS_ARGS (default "-comp zstd -Xcompression-level 3";
#   set to "" for Apptainer's default gzip: same size, about 90 s slower on 2 cores), SCALELM_BUILD_IN_RAM
#   (auto: stage in a tmpfs when 6 GB are free; no: on disk), SCALELM_CACHE_DIR, SCALELM_DEBIAN_MIRROR.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"

rebuild=0 download_only=0 out="" ARCH=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --rebuild) rebuild=1 ;;
        --download-only) download_only=1 ;;
        --arch) [[ $# -ge 2 ]] || die "--arch needs a value (amd64, arm64)"; ARCH=$2; shift ;;
        --arch=*) ARCH=${1#--arch=} ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option: $1" ;;
        *) [[ -z "$out" ]] || die "one output only"; out="$1" ;;
    esac
    shift
done
[[ -n "$out" || $download_only -eq 1 ]] || die "usage: $0 [--rebuild] [--arch ARCH] [--download-only] OUT.sif"
HOST_ARCH=$(host_arch)
ARCH=${ARCH:-$HOST_ARCH}
QEMU_ARCH=$(qemu_name "$ARCH") || die "unknown architecture $ARCH: amd64, arm64, ppc64le, s390x or riscv64"
need_root
APPTAINER="$SCALELM_APPTAINER_BINDIR/apptainer"
[[ $download_only -eq 1 || -x "$APPTAINER" ]] || die "no $APPTAINER: run .ci/apptainer/setup.sh first"
suffix=""   # this host's architecture keeps the caches' plain names
if [[ "$ARCH" != "$HOST_ARCH" ]]; then
    suffix="-$ARCH"
    [[ $download_only -eq 1 ]] || bash "$here/emulation.sh" status "$ARCH" \
        || die "this $HOST_ARCH host cannot run $ARCH binaries: run .ci/apptainer/emulation.sh on $ARCH first"
fi
# pip's options for wheels of the image's platform (none: the host's own)
platform_opts=()
[[ -n "$suffix" ]] && platform_opts=(--platform "manylinux_2_28_$QEMU_ARCH" --python-version 3.11
                                     --implementation cp --abi cp311)

if [[ -n "${SCALELM_TORCH_WHEEL:-}" ]]; then
    WHEEL=$SCALELM_TORCH_WHEEL
elif [[ -z "$suffix" ]]; then
    WHEEL=$SCALELM_WHEEL_CACHE/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
else
    torch_dir="$SCALELM_CACHE_DIR/wheels$suffix"
    mkdir -p "$torch_dir"
    torch_version=${SCALELM_TORCH_VERSION:-2.10.0}
    WHEEL=$(compgen -G "$torch_dir/torch-$torch_version-cp311-cp311-*_$QEMU_ARCH.whl" | head -n1 || true)
    if [[ -z "$WHEEL" ]]; then
        log "downloading torch $torch_version for $ARCH (manylinux_2_28_$QEMU_ARCH, cp311) into $torch_dir"
        python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
            "${platform_opts[@]}" --dest "$torch_dir" "torch==$torch_version" \
            || die "pip could not download torch $torch_version for $ARCH: set SCALELM_TORCH_VERSION or SCALELM_TORCH_WHEEL"
        WHEEL=$(compgen -G "$torch_dir/torch-$torch_version-cp311-cp311-*_$QEMU_ARCH.whl" | head -n1) \
            || die "pip downloaded no torch-$torch_version-cp311-cp311-*_$QEMU_ARCH.whl into $torch_dir: set" \
                   "SCALELM_TORCH_VERSION to a version PyPI has for $ARCH, or SCALELM_TORCH_WHEEL"
    fi
fi
PIP_EXTRA="${SCALELM_BASE_PIP_EXTRA-numpy}"
CA_DIR="${SCALELM_EXTRA_CA_DIR:-/usr/local/share/ca-certificates}"
SQUASH_ARGS="${SCALELM_MKSQUASHFS_ARGS-"-comp zstd -Xcompression-level 3"}"
PACKAGES="python3,python3-pip,python3-venv,python-is-python3,ca-certificates"
SUITE=bookworm
[[ -f "$WHEEL" ]] || die "no torch wheel at $WHEEL"
torch_req="$(basename "$WHEEL" | cut -d- -f1)==$(basename "$WHEEL" | cut -d- -f2)"   # torch==2.13.0+cpu

out_abs="$(readlink -f "$(dirname "$out")")/$(basename "$out")"
key_src="v1 $ARCH $SUITE $PACKAGES $(cat "$CA_DIR"/*.crt 2>/dev/null | sha256sum | cut -c1-16) $(stat -c '%n %s %Y' "$WHEEL") $PIP_EXTRA $SQUASH_ARGS $(sha256sum "$0" | cut -c1-16)"
key="$(echo "$key_src" | sha256sum | cut -c1-16)"
cached="$SCALELM_CACHE_DIR/base-images/base$suffix-$key.sif"
t0=$SECONDS

if [[ $download_only -eq 0 && $rebuild -eq 0 && -f "$cached" ]]; then
    cp --reflink=auto "$cached" "$out_abs"
    log "base image from cache ($cached) -> $out_abs in $((SECONDS - t0)) s"
    exit 0
fi

# 1. torch's dependencies, fetched by the host's pip (it knows the host's indexes) into a reusable wheelhouse.
wh="$SCALELM_CACHE_DIR/wheelhouse$suffix"
mkdir -p "$wh"
# torch's requirements for the image's machine: pip would judge their markers (platform_machine) by the host's
mapfile -t deps < <(python3 "$here/torch_requirements.py" "$WHEEL" "$QEMU_ARCH")
index_opt=--no-index
pip_log=$(mktemp)
# shellcheck disable=SC2086
if [[ ${#deps[@]} -gt 0 || -n "${PIP_EXTRA// /}" ]] &&
   ! python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: "${platform_opts[@]}" \
        --find-links "$wh" --dest "$wh" "${deps[@]}" $PIP_EXTRA > "$pip_log" 2>&1; then
    grep -v 'is ignored: it is neither' "$pip_log" >&2 || true
    missing=$(sed -n 's/^ERROR: No matching distribution found for //p' "$pip_log" | paste -sd' ' -)
    rm -f "$pip_log"
    # the point of --download-only is a later build without PyPI: a wheelhouse that lacks some is a failure
    [[ $download_only -eq 0 ]] || die "pip could not download ${missing:-${deps[*]} $PIP_EXTRA} for $ARCH into $wh" \
        "(pip's output above): run this where PyPI (or the host's pip index) is reachable, or put the wheels there"
    log "warning: the host's pip download failed; the chroot's pip will use PyPI"
    index_opt=""
fi

rm -f "$pip_log"
if [[ $download_only -eq 1 ]]; then
    log "downloaded for $ARCH: $(basename "$WHEEL") in $(dirname "$WHEEL"), $(find "$wh" -name '*.whl' | wc -l) wheels in $wh"
    exit 0
fi

ensure_host_pkg mmdebstrap mmdebstrap
[[ -z "$suffix" ]] || ensure_host_pkg arch-test arch-test   # mmdebstrap's check that the host runs $ARCH
stage="$(mktemp -d "$SCALELM_CACHE_DIR/base-build.XXXXXX")"
trap 'umount -l "$stage" 2>/dev/null || true; rm -rf "$stage"' EXIT
trap 'exit 130' INT TERM
# Build in RAM when there is room (about 3 GB used at the peak): the many small files of the rootfs and
# Apptainer's copy of it make this step disk-bound otherwise (about 2x slower here).
mem_gb=$(awk '/^MemAvailable:/ {print int($2 / 1048576)}' /proc/meminfo)
if [[ "${SCALELM_BUILD_IN_RAM:-auto}" != no ]] && (( mem_gb >= 6 )); then
    mount -t tmpfs -o size=5g,mode=0755 scalelm-base-build "$stage"
    export APPTAINER_TMPDIR="${APPTAINER_TMPDIR:-/dev/shm}"   # the host tmpfs, bound by the wrapper
fi
rootfs="$stage/rootfs"

# 2. Debian bookworm minbase with Python.
mapfile -t opts < <(mmdebstrap_opts "$SCALELM_CACHE_DIR/debs-$SUITE$suffix")
log "bootstrapping Debian $SUITE ($ARCH) + $PACKAGES"
mmdebstrap --quiet --architectures="$ARCH" "${opts[@]}" --include="$PACKAGES" "$SUITE" "$rootfs" "$(debian_mirror)"
t1=$SECONDS

# The host's extra CA certificates (this machine reaches PyPI through a TLS-intercepting proxy): without
# them pip in the image (e.g. in the scalelm.def %post) cannot reach PyPI here.
if compgen -G "$CA_DIR/*.crt" >/dev/null; then
    mkdir -p "$rootfs/usr/local/share/ca-certificates"
    cp "$CA_DIR"/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
fi

# 3. pip install in the chroot, from local files (network only for what the wheelhouse lacks).
log "installing $(basename "$WHEEL") $PIP_EXTRA"
mkdir -p "$rootfs/mnt/wheel" "$rootfs/mnt/wheelhouse"
cat /etc/resolv.conf > "$rootfs/etc/resolv.conf" 2>/dev/null || true
# shellcheck disable=SC2086,SC2016
unshare --mount --propagation private -- /bin/bash -euc '
    r=$1; shift
    mount --bind "$(dirname "$1")" "$r/mnt/wheel"; mount --bind "$2" "$r/mnt/wheelhouse"
    mount -t proc proc "$r/proc"
    shift 2
    chroot "$r" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
        PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
        python3 -m pip install --quiet --no-cache-dir --break-system-packages --root-user-action=ignore \
        --disable-pip-version-check --find-links /mnt/wheel --find-links /mnt/wheelhouse "$@"
' _ "$rootfs" "$WHEEL" "$wh" $index_opt "$torch_req" $PIP_EXTRA
rmdir "$rootfs/mnt/wheel" "$rootfs/mnt/wheelhouse"
t2=$SECONDS

# 4. Clean up for a small, bootstrap-able image.
rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED   # pip installs work as in the NGC/PyTorch images
rm -rf "${rootfs:?}"/dev/* "$rootfs"/root/.cache "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
       "$rootfs"/var/cache/apt/archives/partial "$rootfs"/var/lib/apt/lists/partial "$rootfs"/var/log/*.log
: > "$rootfs/etc/resolv.conf"
# Shift non-root owners into the subuid range the wrapper maps (namespace id N = host id START+N-1), so
# that inside Apptainer's user namespace they keep their ids. chown clears set[ug]id bits: restore the mode.
shift_by=$((SCALELM_SUBID_START - 1))
find "$rootfs" \( ! -uid 0 -o ! -gid 0 \) -printf '%U %G %m %p\0' |
    while IFS=' ' read -r -d '' u g m p; do
        (( u > 0 )) && u=$((u + shift_by)); (( g > 0 )) && g=$((g + shift_by))
        chown -h "$u:$g" "$p"; [[ -L "$p" ]] || chmod "$m" "$p"
    done

# 5. SIF (the staging dir is under the cache dir: make the wrapper bind it).
log "building the SIF (mksquashfs args: ${SQUASH_ARGS:-default})"
mkdir -p "$SCALELM_CACHE_DIR/base-images"
sqargs=(); [[ -n "$SQUASH_ARGS" ]] && sqargs=(--mksquashfs-args "$SQUASH_ARGS")
SCALELM_APPTAINER_BINDS="$stage:$SCALELM_CACHE_DIR/base-images${SCALELM_APPTAINER_BINDS:+:$SCALELM_APPTAINER_BINDS}" \
    "$APPTAINER" --quiet build --force "${sqargs[@]}" "$stage/base.sif" "$rootfs"
mv -f "$stage/base.sif" "$cached"
cp --reflink=auto "$cached" "$out_abs"
built_for=$("$APPTAINER" sif header "$out_abs" | sed -n 's/^Primary Architecture:[[:space:]]*//p')
[[ "$built_for" == "$ARCH" ]] || die "the SIF header of $out_abs says $built_for, not $ARCH"
t3=$SECONDS
log "base image $out_abs ($ARCH, $(du -h "$out_abs" | cut -f1)): mmdebstrap $((t1 - t0)) s, pip $((t2 - t1)) s, sif $((t3 - t2)) s, total $((t3 - t0)) s"
