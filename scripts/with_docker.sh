#!/usr/bin/env bash
# Run a command with a working Docker: `scripts/with_docker.sh CMD [ARGS...]` (`make images`,
# `make image-test`).
#
# - Docker missing: under CI (CI set, root, apt-get) it is installed from the system's packages
#   (Debian's docker.io; debootstrap too, for scripts/images.sh's base); anywhere else this says
#   what to install and exits 1.
# - No daemon answering: as root, a dockerd is started for CMD (`--iptables=false --bridge=none`:
#   every container here runs on the host network, so it needs no bridge and no NAT rules) and
#   stopped when CMD ends; a daemon that was already running is used and left alone.
# - HETERO_DOCKER is exported: a client that builds with BuildKit (scripts/images.sh) and runs
#   containers (tests/images/). A `docker` without buildx cannot use BuildKit from version 23 on;
#   Debian's own client (/usr/bin/docker, 20.10) can, with DOCKER_BUILDKIT=1.
set -euo pipefail

say() { echo "with_docker: $*" >&2; }

install_under_ci() {
    # Debian's docker.io (dockerd and a client that builds with BuildKit) and debootstrap
    # (scripts/images.sh's base where Docker Hub cannot be reached), under CI only.
    if [[ -n "${CI:-}" && "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        say "$1: installing Debian's docker.io and debootstrap (CI)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
    else
        install_hint "$1"
    fi
}

install_hint() {
    say "$1"
    say "install Docker Engine (https://docs.docker.com/engine/install/; on Debian or Ubuntu:"
    say "  sudo apt-get install docker.io debootstrap), start it (sudo systemctl start docker)"
    say "  and run this again. CI installs it itself (CI set, as root, with apt-get)."
    exit 1
}

pick_client() {
    local cli version
    for cli in "$(command -v docker || true)" /usr/bin/docker; do
        [[ -x "$cli" ]] || continue
        if "$cli" buildx version >/dev/null 2>&1; then
            echo "$cli"
            return 0
        fi
        version="$("$cli" version --format '{{.Client.Version}}' 2>/dev/null || true)"
        if [[ "${version%%.*}" =~ ^[0-9]+$ && "${version%%.*}" -lt 23 ]]; then
            echo "$cli"
            return 0
        fi
    done
    return 1
}

if ! HETERO_DOCKER="$(pick_client)"; then
    install_under_ci "no Docker client here builds with BuildKit (no docker, or one without buildx)"
    HETERO_DOCKER="$(pick_client)" || install_hint "install the buildx plugin (docker-buildx)."
fi
export HETERO_DOCKER

started=""
cleanup() {
    if [[ -n "$started" ]]; then
        say "stopping the dockerd this started (pid $started)"
        kill "$started" 2>/dev/null || true
        for _ in $(seq 1 60); do
            kill -0 "$started" 2>/dev/null || break
            sleep 0.5
        done
    fi
}
trap cleanup EXIT

if ! "$HETERO_DOCKER" info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || install_under_ci "no Docker daemon answers and none is installed"
    if [[ "$(id -u)" != 0 ]]; then
        install_hint "no Docker daemon answers (docker info failed) and only root can start one."
    fi
    log="${TMPDIR:-/tmp}/hetero-dockerd.log"
    say "no Docker daemon answers: starting dockerd (log: $log)"
    dockerd --iptables=false --bridge=none >"$log" 2>&1 &
    started=$!
    for _ in $(seq 1 120); do
        "$HETERO_DOCKER" info >/dev/null 2>&1 && break
        kill -0 "$started" 2>/dev/null || { tail -20 "$log" >&2; say "dockerd exited"; exit 1; }
        sleep 0.5
    done
    "$HETERO_DOCKER" info >/dev/null 2>&1 || { tail -20 "$log" >&2; say "dockerd never answered"; exit 1; }
fi

"$@"
