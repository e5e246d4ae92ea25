#!/usr/bin/env bash
# Entry point of the image: maps SageMaker's `train` argument (and no argument at all) to
# `hetero launch --spec SPEC [--group NAME]`; any other arguments go to `hetero` unchanged,
# e.g. `docker run IMAGE launch --spec /path --group trainer` or `docker run IMAGE spec check`.
#   HETERO_SPEC   spec path (default: the spec baked into the image, /opt/hetero/cluster.toml)
#   HETERO_GROUP  instance group (default: the launcher finds it from SageMaker or EC2 tags)
set -euo pipefail

if [[ $# -eq 0 || "$1" == "train" ]]; then
    if [[ $# -gt 0 ]]; then
        shift
    fi
    spec="${HETERO_SPEC:-/opt/hetero/cluster.toml}"
    group_args=()
    if [[ -n "${HETERO_GROUP:-}" ]]; then
        group_args=(--group "${HETERO_GROUP}")
    fi
    exec hetero launch --spec "${spec}" ${group_args[@]+"${group_args[@]}"} "$@"
fi

exec hetero "$@"
