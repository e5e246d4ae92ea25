#!/usr/bin/env bash
# `make images`: build both targets of containers/Dockerfile as hetero-train:trainer and
# hetero-train:data-server (run through scripts/with_docker.sh, which provides $HETERO_DOCKER).
#
# With Docker Hub, AWS's EFA installer site and PyTorch's CPU index reachable, this builds exactly
# what `cdk deploy` builds (the Dockerfile's defaults). Where one of them cannot be reached it says
# so and builds with the named build argument that leaves the part out or stands in for it; the
# image's /opt/hetero/image.json records what was left out:
#   Docker Hub      BASE_IMAGE=hetero-base:bookworm, the same Debian release (12, bookworm) made
#                   from Debian's packages with debootstrap and `docker import`
#   EFA installer   EFA_INSTALLER=none (no EFA stack in the trainer)
#   PyTorch's index TORCH_FROM=pypi (the data server gets PyPI's CUDA build of the same torch)
# The system's CA bundle, when there is one, is handed to pip as the BuildKit secret ca_bundle
# (for networks that inspect TLS); a secret never lands in a layer.
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER="${HETERO_DOCKER:-docker}"
REPO=hetero-train
LOCAL_BASE=hetero-base:bookworm
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
say() { echo "make images: $*" >&2; }

reachable() { curl -fsS --max-time 20 -o /dev/null "$1" 2>/dev/null; }
command -v curl >/dev/null || { say "curl is needed to check which download sites answer"; exit 1; }

build_args=()

base="$(sed -n 's/^ARG BASE_IMAGE=//p' containers/Dockerfile)"
if "$DOCKER" image inspect "$base" >/dev/null 2>&1 || "$DOCKER" pull -q "$base" >/dev/null 2>&1; then
    say "base: $base"
else
    say "base: $base cannot be pulled (Docker Hub unreachable): building on $LOCAL_BASE," \
        "Debian 12 (bookworm) from Debian's packages (BASE_IMAGE=$LOCAL_BASE)"
    if ! "$DOCKER" image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || {
            say "debootstrap is not installed: apt-get install debootstrap"
            exit 1
        }
        rootfs="$(mktemp -d)"
        trap 'rm -rf "$rootfs"' EXIT
        say "debootstrap --variant=minbase bookworm from $DEBIAN_MIRROR (a few minutes)"
        debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >"$rootfs.log" 2>&1 \
            || { tail -20 "$rootfs.log" >&2; say "debootstrap failed"; exit 1; }
        rm -f "$rootfs.log"
        # An imported image has no environment of its own: the PATH the official images set.
        tar -C "$rootfs" -c . | "$DOCKER" import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'CMD ["bash"]' - "$LOCAL_BASE" >/dev/null
        rm -rf "$rootfs"
    fi
    build_args+=(--build-arg "BASE_IMAGE=$LOCAL_BASE")
fi

if reachable https://efa-installer.amazonaws.com/aws-efa-installer.key; then
    say "EFA installer: reachable, installed in the trainer"
else
    say "EFA installer: efa-installer.amazonaws.com cannot be reached: LEFT OUT (EFA_INSTALLER=none)"
    build_args+=(--build-arg EFA_INSTALLER=none)
fi
if reachable https://download.pytorch.org/whl/cpu/torch/; then
    say "PyTorch's CPU index: reachable, the data server gets the CPU builds"
else
    say "PyTorch's CPU index cannot be reached: the data server gets PyPI's CUDA build of the" \
        "same torch (TORCH_FROM=pypi)"
    build_args+=(--build-arg TORCH_FROM=pypi)
fi

ca=""
for candidate in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
    if [[ -n "$candidate" && -s "$candidate" ]]; then ca="$candidate"; break; fi
done
secret=()
[[ -n "$ca" ]] && secret=(--secret "id=ca_bundle,src=$ca")

if "$DOCKER" buildx version >/dev/null 2>&1; then
    build=("$DOCKER" buildx build --load)
else
    build=(env DOCKER_BUILDKIT=1 "$DOCKER" build)
fi

for target in data-server trainer; do
    say "building $REPO:$target"
    started=$(date +%s)
    log="${TMPDIR:-/tmp}/hetero-build-$target.log"
    # Progress: each step as it starts and ends; the whole output goes to $log.
    set +o pipefail
    "${build[@]}" --network host --progress plain --target "$target" --tag "$REPO:$target" \
        ${secret[@]+"${secret[@]}"} ${build_args[@]+"${build_args[@]}"} \
        --file containers/Dockerfile . 2>&1 | tee "$log" \
        | grep --line-buffered -E '^#[0-9]+ (\[|DONE|ERROR|CACHED)|LEFT OUT' >&2
    status=${PIPESTATUS[0]}
    set -o pipefail
    if [[ "$status" != 0 ]]; then
        tail -40 "$log" >&2
        say "$target: the build failed (exit $status; whole output: $log)"
        exit 1
    fi
    created="$("$DOCKER" image inspect -f '{{.Created}}' "$REPO:$target")"
    size="$("$DOCKER" image inspect -f '{{.Size}}' "$REPO:$target")"
    say "$REPO:$target: $(awk -v b="$size" 'BEGIN { printf "%.2f GB", b / 1e9 }')" \
        "(created $created, built in $(( $(date +%s) - started )) s)"
    "$DOCKER" run --rm --entrypoint cat "$REPO:$target" /opt/hetero/image.json >&2
done
