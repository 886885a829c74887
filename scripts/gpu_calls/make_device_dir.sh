#!/usr/bin/env bash
# Build the ignored .device/ folder that the queued GPU calls carry (run from the repo root, on
# the CPU machine): the CuTe DSL tarball and `git archive`s of the trees the timing calls compare
# against. Then: run(command="source scripts/gpu_calls/pre.sh; source scripts/gpu_calls/callN.sh",
# carry=[".device"], timeout_s=600). The travelling tree stays under 64 MiB (~61 MiB).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.device/' .git/info/exclude || echo '/.device/' >> .git/info/exclude
mkdir -p .device
src=${CUTLASS_TARBALL:-../shared/device/cutlass_dsl_cp312_cu13.tar.xz}
[ -f .device/cutlass_dsl_cp312_cu13.tar.xz ] || cp "$src" .device/
# name -> commit: base = main before session 17 (55c788a), prewin = before the byte windows
# (518d8db), prev = before the MoE FC1 one-token row (3903503), cur = the first transform-free
# prefill (e6955a8: fp32 butterflies in phase 1), s27 = main at the end of session 27 (f42c551:
# before the two-pipe K4 extraction), s38 = main at the end of session 38 (e16e6fc: the prefill
# fold rule, no barrier in bench's timing loop), s42 = main at the start of session 42 (4bd7dc8).
# Only what an install needs travels.
for pair in base:55c788a prewin:518d8db prev:3903503 cur:e6955a8 s27:f42c551 s38:e16e6fc s42:4bd7dc8; do
    name=${pair%%:*}; rev=${pair#*:}
    git archive "$rev" pyproject.toml README.md exl3_jax ffi models scripts | xz -T2 -6 > ".device/$name.tar.xz"
done
du -sh .device
