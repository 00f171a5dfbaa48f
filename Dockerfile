# One image for the three specdec services (draft_service, verify_service, gateway);
# docker-compose.yml picks the program per service.
#
# The base is a build argument: a CUDA runtime by default, for GPU hosts (pip then
# installs the CUDA build of the locked torch). Any Debian or Ubuntu base works; Python
# 3.11+ and venv are installed from its apt sources when it lacks them.
#
# Files in an optional `pip-extras/` folder of the build context are handed to pip: wheels
# as --find-links, `ca-certificates.crt` as its CA bundle (for a TLS proxy). They are
# deleted after the install but stay in a layer below it: put nothing secret there.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- deps: Python and the locked runtime dependencies (changes only with
# requirements.lock, pyproject.toml or this stage; tests cache it by their hash)
FROM ${BASE_IMAGE} AS deps
# Metadata first: on storage without copy-on-write (vfs) every instruction copies the
# whole file system, cheapest before the dependencies are in it.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN set -eu; \
    if ! python3 -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "the base image's python3 is older than 3.11" >&2; exit 1; }
# `pip-extras*` matches nothing in an ordinary checkout, which COPY allows next to real files.
COPY requirements.lock pyproject.toml pip-extras* /tmp/deps/
RUN set -eu; cd /tmp/deps; \
    if [ -f ca-certificates.crt ]; then export PIP_CERT=/tmp/deps/ca-certificates.crt; fi; \
    python3 -m venv /opt/venv; \
    # the runtime dependencies of pyproject.toml, at the versions requirements.lock pins
    python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > runtime.txt; \
    pip install --find-links /tmp/deps -c requirements.lock -r runtime.txt; \
    # C++ headers serve only extension builds; they are a quarter of the image's files
    rm -rf /opt/venv/lib/python3*/site-packages/torch/include /tmp/deps

# ---- the services: one layer of sources (and the embedded model pair)
FROM deps
COPY . /app
