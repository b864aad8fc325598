# Shared setup for scripts/test and scripts/demo: sourced, not run.
# Creates (or reuses) .venv, installs elastic_kit with its extras under constraints.txt,
# and installs the Debian packages the tests need. Re-running is cheap: the pip step is
# skipped while setup.cfg and constraints.txt are unchanged.
set -euo pipefail
EK_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ELASTIC_KIT_VENV:-$EK_ROOT/.venv}"
PY="$VENV/bin/python"

ek_log() { printf '[elastic_kit setup] %s\n' "$*" >&2; }

ek_python() {
  # The interpreter that makes the venv: python3.11 when present (what constraints.txt was made with).
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1; then echo "$cand"; return; fi
  done
  ek_log "no python3 found"; exit 1
}

ek_apt() {
  # ek_apt PKG BINARY: install a Debian package unless BINARY is already on PATH.
  local pkg=$1 bin=$2
  command -v "$bin" >/dev/null 2>&1 && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  ek_log "installing Debian package $pkg"
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$pkg" >/dev/null
}

ek_setup() {
  # ek_setup EXTRAS: venv + package with those extras (comma separated).
  local extras=$1
  if [ ! -x "$PY" ]; then
    ek_log "creating virtual environment $VENV"
    "$(ek_python)" -m venv "$VENV"
  fi
  local stamp="$VENV/.elastic_kit-$(cat "$EK_ROOT/setup.cfg" "$EK_ROOT/constraints.txt" | sha256sum | cut -c1-16)-${extras//,/_}"
  if [ ! -f "$stamp" ]; then
    ek_log "installing elastic_kit[$extras] under constraints.txt (torch takes a minute)"
    # This machine's pip config names local index folders that may not exist; pip
    # warns about each one. Drop only those lines, keep pip's exit status.
    "$PY" -m pip install -q --disable-pip-version-check -c "$EK_ROOT/constraints.txt" -e "$EK_ROOT[$extras]" 2>&1 \
      | { grep -v "^WARNING: Location '.*' is ignored" || true; } >&2
    [ "${PIPESTATUS[0]}" -eq 0 ] || { ek_log "pip install failed"; exit 1; }
    touch "$stamp"
  fi
}
