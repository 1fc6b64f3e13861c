# Source from the repository's root: podman as deploy/podman/setup.sh configures it, and podman-compose beside it.
#   source deploy/podman/env.sh && podman ps && podman-compose -f deploy/docker-compose.yml ps
DEPLOY_STATE="$PWD/.pdserve/deploy"
export CONTAINERS_CONF="$DEPLOY_STATE/containers.conf"
export PATH="$DEPLOY_STATE/tools/bin:$PATH"
# The compose file has no default worker token: a random one for this shell, unless one is set.
PDSERVE_WORKER_TOKEN=${PDSERVE_WORKER_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
export PDSERVE_WORKER_TOKEN
