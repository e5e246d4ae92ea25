#!/bin/sh
# `pip install` in the image build. Where the build was handed a CA bundle as the BuildKit secret
# `ca_bundle` (`make images` passes the system's, for a network that inspects TLS), pip trusts it;
# a secret is mounted for one RUN only and never lands in a layer. Without one, pip's own bundle.
set -eu
if [ -s /run/secrets/ca_bundle ]; then
    export PIP_CERT=/run/secrets/ca_bundle
fi
exec pip install "$@"
