#!/usr/bin/env bash
# Installs northcode into ./.venv and links the `northcode` command onto PATH.
# Idempotent: run it again after a pull. Without an NVIDIA GPU it installs the CPU
# build of torch (small and fast, enough for the tiny demo model and the CPU tests).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "northcode needs Python >= 3.11 (found $("$PY" --version))" >&2; exit 1; }

[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "NVIDIA GPU found: installing a CUDA build of torch"
  "$VPY" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null \
    || "$VPY" -m pip install -q "torch>=2.4"
else
  echo "no NVIDIA GPU: installing the CPU build of torch"
  "$VPY" -c 'import torch' 2>/dev/null \
    || "$VPY" -m pip install -q "torch==2.13.0"
fi

"$VPY" -m pip install -q -e ".[test]"

# Put `northcode` on PATH: the first writable directory of ~/.local/bin, /usr/local/bin.
target=""
for dir in "$HOME/.local/bin" /usr/local/bin; do
  case ":$PATH:" in *":$dir:"*) ;; *) continue ;; esac
  if [ -w "$dir" ] || { [ ! -e "$dir" ] && mkdir -p "$dir" 2>/dev/null; }; then target=$dir; break; fi
done
link="$target/northcode" want="$PWD/.venv/bin/northcode"
if [ -n "$target" ] && [ -e "$link" ] && [ ! -L "$link" ]; then
  echo "left alone: $link is a file, not a link from an earlier install; run $want, or remove it and re-run" >&2
elif [ -n "$target" ]; then
  old=$(readlink "$link" 2>/dev/null || true)
  ln -sfn "$want" "$link"
  echo "installed: $link -> $want"
  if [ -n "$old" ] && [ "$old" != "$want" ]; then
    echo "note: $link pointed to $old (another checkout); to keep that one: ln -sfn '$old' '$link'"
  fi
else
  echo "installed: $PWD/.venv/bin/northcode (add $PWD/.venv/bin to PATH)"
fi
"$VPY" -m northcode.cli doctor --brief || true
