#!/usr/bin/env bash
# Entry point of the image: maps SageMaker's `train` argument (and no argument at all) to
# `hetero launch --spec "$HETERO_SPEC" [--group NAME]`; any other arguments go to `hetero`
# unchanged, e.g. `docker run IMAGE launch --spec /path --group trainer` or `docker run IMAGE spec
# check --spec /path`.
#   HETERO_SPEC   spec path (required: the spec is not in the image; the EC2 user data mounts the
#                 deployed one, `hetero sagemaker submit` passes it as the `spec` input channel)
#   HETERO_GROUP  instance group (default: the launcher finds it from SageMaker or EC2 tags)
set -euo pipefail

if [[ $# -eq 0 || "$1" == "train" ]]; then
    if [[ $# -gt 0 ]]; then
        shift
    fi
    if [[ -z "${HETERO_SPEC:-}" ]]; then
        echo "hetero-entrypoint: HETERO_SPEC is not set. The image carries no spec: set" \
            "HETERO_SPEC to the spec's path in the container (the EC2 user data mounts it at" \
            "/opt/hetero/deployed/cluster.toml; 'hetero sagemaker submit' passes it as the" \
            "'spec' channel, /opt/ml/input/data/spec/)." >&2
        exit 2
    fi
    group_args=()
    if [[ -n "${HETERO_GROUP:-}" ]]; then
        group_args=(--group "${HETERO_GROUP}")
    fi
    exec hetero launch --spec "${HETERO_SPEC}" ${group_args[@]+"${group_args[@]}"} "$@"
fi

exec hetero "$@"
