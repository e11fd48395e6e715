#!/usr/bin/env bash
# Build docker/Dockerfile (CPU) on this platform and smoke-test the image. Run as root from anywhere:
#     docker/build-cpu.sh
# This platform has no container registry, no Docker daemon and no working `docker/podman run`, so:
#   1. the base image is made from Debian packages: debootstrap a bookworm root, commit it with buildah as
#      localhost/kvserve-base:bookworm (skipped when that image exists);
#   2. the image is built with `buildah bud --isolation chroot` (no namespaces needed), with torch's CPU wheel taken
#      from the host's /opt/wheels through a build-time volume, so nothing but PyPI and deb.debian.org is contacted;
#   3. the smoke test runs the image's entrypoint with `buildah run --isolation chroot` (host network, bound to
#      127.0.0.1 on a free port), waits for /health, sends one completion with eviction forced and checks the
#      response header and kvserve:evictions_total on /metrics. Only loopback is contacted. Prints PASS or FAIL.
# Environment (all optional): IMAGE (localhost/kvserve:cpu), BASE_IMAGE (localhost/kvserve-base:bookworm),
# DEBIAN_MIRROR (http://deb.debian.org/debian), WHEELS (/opt/wheels),
# CA_BUNDLE (/etc/ssl/certs/ca-certificates.crt), WORKDIR_BASE (/var/tmp/kvserve-build),
# HEALTH_TIMEOUT_S (900), SKIP_BUILD=1 (smoke-test an existing image only), SMOKE_CACHE=DIR (use and keep this
# folder as the model-cache volume instead of a fresh one: a second run then times a warm restart).
# Needs: apt-get install -y buildah debootstrap curl python3.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${IMAGE:-localhost/kvserve:cpu}
BASE_IMAGE=${BASE_IMAGE:-localhost/kvserve-base:bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEELS=${WHEELS:-/opt/wheels}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
WORKDIR_BASE=${WORKDIR_BASE:-/var/tmp/kvserve-build}
HEALTH_TIMEOUT_S=${HEALTH_TIMEOUT_S:-900}
# chroot isolation: this machine is itself a container/VM without the privileges for buildah's OCI runtime isolation.
export BUILDAH_ISOLATION=chroot

log() { printf '[build-cpu %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (debootstrap and buildah's chroot isolation need it)"
for tool in buildah debootstrap curl python3; do
  command -v "$tool" >/dev/null || die "$tool is missing: apt-get install -y buildah debootstrap curl"
done

# ---------------------------------------------------------------------------------------------------------------
# 1. Base image from Debian packages (no registry here).
# ---------------------------------------------------------------------------------------------------------------
make_base() {
  if buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base image $BASE_IMAGE exists, skipping debootstrap"
    return
  fi
  local rootfs="$WORKDIR_BASE/bookworm-rootfs"
  # A half-finished debootstrap from an interrupted run cannot be resumed reliably: start over.
  rm -rf "$rootfs"
  mkdir -p "$rootfs"
  log "debootstrap bookworm (minbase) from $DEBIAN_MIRROR into $rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR"
  # Security and point-release updates, as in Debian's own images, so the Dockerfile's apt-get sees them.
  cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR bookworm main
deb $DEBIAN_MIRROR bookworm-updates main
deb ${DEBIAN_MIRROR%/debian}/debian-security bookworm-security main
EOF
  # Keep the image small and do not bake in the host's resolver or package lists (buildah injects resolv.conf).
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/etc/resolv.conf
  : > "$rootfs/etc/resolv.conf"
  local ctr mnt
  ctr=$(buildah from scratch)
  mnt=$(buildah mount "$ctr")
  # tar keeps owners, modes, device nodes and hard links exactly as debootstrap made them.
  tar -C "$rootfs" --numeric-owner -cf - . | tar -C "$mnt" --numeric-owner -xpf -
  buildah umount "$ctr" >/dev/null
  # A scratch image has no environment: without PATH the Dockerfile's `ENV PATH=/opt/venv/bin:$PATH` and apt break.
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd /bin/bash --os linux --arch amd64 \
    --label org.opencontainers.image.description="Debian bookworm minbase, debootstrap from $DEBIAN_MIRROR" "$ctr"
  buildah commit --rm "$ctr" "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  log "base image $BASE_IMAGE committed"
}

# ---------------------------------------------------------------------------------------------------------------
# 2. The kvserve image.
# ---------------------------------------------------------------------------------------------------------------
build_image() {
  [[ -d $WHEELS ]] || die "$WHEELS (the torch CPU wheel folder) does not exist"
  log "buildah bud $IMAGE (base $BASE_IMAGE, torch from $WHEELS)"
  local t0=$SECONDS
  # --pull=never: the base exists only locally. --format docker: OCI images drop HEALTHCHECK. --force-rm: no
  # working container is left behind by a failed step. --layers: a rerun
  # with unchanged inputs reuses every step (cheap idempotence); a code change reuses the dependency layer.
  # PIP_EXTRA_ARGS replaces the default (PyTorch's CPU index, unreachable here) with the mounted wheel folder, and
  # gives pip the host's CA bundle: HTTPS to PyPI goes through a TLS-intercepting proxy whose CA only the host's
  # bundle carries (Debian's ca-certificates in the image does not). Both are build-time volumes, not in the image.
  (cd "$REPO" && buildah bud --isolation chroot --layers --force-rm --pull=never --format docker \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg PIP_EXTRA_ARGS="--find-links /wheels --cert /build-ca/ca-certificates.crt" \
    -v "$WHEELS:/wheels:ro" -v "$CA_BUNDLE:/build-ca/ca-certificates.crt:ro" \
    -t "$IMAGE" -f docker/Dockerfile .)
  BUILD_S=$((SECONDS - t0))
  log "built $IMAGE in ${BUILD_S}s"
}

# ---------------------------------------------------------------------------------------------------------------
# 3. Smoke test: the entrypoint inside the image, one real completion with eviction, metrics.
# ---------------------------------------------------------------------------------------------------------------
SMOKE_CTR="" SERVER_PID="" CACHE_DIR=""
cleanup() {
  local rc=$?
  if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    log "stopping the server (process group $SERVER_PID)"
    # The server was started with setsid: its pid is the group of vLLM's API server and engine-core processes.
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  if [[ -n $SMOKE_CTR ]]; then buildah rm "$SMOKE_CTR" >/dev/null 2>&1 || true; fi
  if [[ -n $CACHE_DIR ]]; then rm -rf "$CACHE_DIR"; fi
  # Every failure (a die, a failed build step under set -e, the smoke checks) ends with one clear line.
  if [[ $rc -ne 0 ]]; then echo "build-cpu.sh RESULT: FAIL (exit $rc; see the lines above)"; fi
}
trap cleanup EXIT

smoke() {
  local port log t0 health_s
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  log="$WORKDIR_BASE/smoke-server.log"
  mkdir -p "$WORKDIR_BASE"
  # A fresh, empty model cache each run, like a new `docker run -v VOLUME`: the first start converts the GGUF and
  # compiles the model. CACHE_DIR is removed on exit; SMOKE_CACHE is kept.
  local cache
  if [[ -n ${SMOKE_CACHE:-} ]]; then
    cache=$SMOKE_CACHE
    mkdir -p "$cache"
  else
    CACHE_DIR=$(mktemp -d "$WORKDIR_BASE/cache.XXXXXX")
    cache=$CACHE_DIR
  fi
  chown 1000:1000 "$cache"
  SMOKE_CTR=$(buildah from --pull=never "$IMAGE")
  log "starting the entrypoint in $SMOKE_CTR on 127.0.0.1:$port (log: $log)"
  t0=$SECONDS
  # buildah run does not run ENTRYPOINT by itself: call it as the image would. The user (kvserve) and the env come
  # from the image's config. Offline hub, no usage stats and VLLM_HOST_IP (vLLM otherwise picks the machine's own
  # address for its internal queues) keep the server to loopback.
  setsid buildah run --isolation chroot --network host \
    -v "$cache:/home/kvserve/.cache/kvserve" \
    -e HF_HUB_OFFLINE=1 -e VLLM_NO_USAGE_STATS=1 -e DO_NOT_TRACK=1 -e VLLM_HOST_IP=127.0.0.1 \
    "$SMOKE_CTR" -- kvserve-entrypoint --host 127.0.0.1 --port "$port" > "$log" 2>&1 &
  SERVER_PID=$!
  local url="http://127.0.0.1:$port"
  until curl -sf --noproxy '*' -o /dev/null "$url/health"; do
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -n 40 "$log" >&2; die "server exited before /health"; }
    (( SECONDS - t0 < HEALTH_TIMEOUT_S )) || { tail -n 40 "$log" >&2; die "no /health within ${HEALTH_TIMEOUT_S}s"; }
    sleep 5
  done
  health_s=$((SECONDS - t0))
  log "/health OK after ${health_s}s (GGUF conversion if the cache is empty, model load, torch.compile)"

  # One completion: a prompt of a few hundred tokens, StreamingLLM at budget 64, so the prompt is evicted after
  # prefill. Python's urllib with no proxy handler: only 127.0.0.1 is contacted.
  python3 - "$url" "$health_s" "${BUILD_S:-n/a}" <<'PY'
import json, sys, urllib.request

url, health_s, build_s = sys.argv[1], sys.argv[2], sys.argv[3]
http = urllib.request.build_opener(urllib.request.ProxyHandler({}))
model = json.load(http.open(f"{url}/v1/models", timeout=30))["data"][0]["id"]
prompt = " ".join(
    f"Note {i}: the lighthouse keeper counted {i * 7} ships passing the northern cape before the storm."
    for i in range(1, 31)
) + " Summarise the notes in one sentence:"
body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0}).encode()
req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={
    "content-type": "application/json", "x-kv-policy": "streamingllm", "x-kv-budget": "64"})
failures = []
try:
    resp = http.open(req, timeout=600)
    status, headers, out = resp.status, resp.headers, json.load(resp)
except urllib.error.HTTPError as exc:
    status, headers, out = exc.code, exc.headers, {"error": exc.read().decode(errors="replace")}
print(f"POST /v1/completions -> HTTP {status}")
for name in ("x-kv-policy-applied", "x-kv-budget-applied"):
    print(f"  {name}: {headers.get(name)}")
if status != 200:
    failures.append(f"HTTP {status}: {out}")
else:
    usage = out.get("usage", {})
    print(f"  usage: {usage}")
    print(f"  text: {out['choices'][0]['text']!r}")
    if usage.get("prompt_tokens", 0) <= 64:
        failures.append(f"prompt too short to evict: {usage}")
if headers.get("x-kv-policy-applied") != "streamingllm":
    failures.append(f"x-kv-policy-applied is {headers.get('x-kv-policy-applied')!r}, expected 'streamingllm'")
metrics = http.open(f"{url}/metrics", timeout=30).read().decode()
lines = [l for l in metrics.splitlines() if l.startswith("kvserve:evictions_total")]
print("  " + "\n  ".join(lines or ["kvserve:evictions_total: absent"]))
total = sum(float(l.rsplit(" ", 1)[1]) for l in lines)
if total <= 0:
    failures.append(f"kvserve:evictions_total is {total}, expected > 0")
print(f"build {build_s}s, /health after {health_s}s, evictions_total {total:g}")
if failures:
    print("smoke checks failed:\n  " + "\n  ".join(failures))
    sys.exit(1)
PY
  echo "build-cpu.sh RESULT: PASS"
}

if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  make_base
  build_image
fi
buildah images "$IMAGE"
smoke
