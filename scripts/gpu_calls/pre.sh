# Sourced first by every queued GPU call (scripts/gpu_calls/callN.sh): CuTe DSL from the carried
# tarball, this tree installed offline, a step timer, and `tree NAME` to switch the Python path to
# a carried `git archive` (.device/NAME.tar.xz, see make_device_dir.sh; the shell moves to its
# folder) or back to this tree (`tree here`, back in the repo root).
set -u
mkdir -p /tmp/site && tar -xJf .device/cutlass_dsl_cp312_cu13.tar.xz -C /tmp/site
export BASE_PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export PYTHONPATH=$BASE_PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
ROOT=$(pwd)
RES=/tmp/res; mkdir -p $RES
# Everything goes into one tarball under $OUT after each step, so a call cut off at its limit
# still returns what it finished (and $OUT's 8-file limit is never reached).
save() { tar -czf "$OUT/${CALL:-call}.tar.gz" -C $RES . ; }
tree() {
    if [ "$1" = here ]; then export PYTHONPATH=$BASE_PYTHONPATH; cd $ROOT; return; fi
    local d=/tmp/tree_$1
    if [ ! -d $d/site ]; then
        mkdir -p $d/src && tar -xJf "$ROOT/.device/$1.tar.xz" -C $d/src && _tree_site $d
    fi
    _tree_enter $1
}
# `tree_patched NAME PATCH`: like `tree`, a tree NAME made of this one with PATCH (a path in this
# repo, `git apply` form) applied: experiments that main does not keep (e.g. timing probes).
tree_patched() {
    local d=/tmp/tree_$1
    if [ ! -d $d/site ]; then
        mkdir -p $d/src && (cd $ROOT && tar -cf - pyproject.toml exl3_jax ffi models) | tar -xf - -C $d/src
        (cd $d/src && git apply "$ROOT/$2") && _tree_site $d || return 1
    fi
    _tree_enter $1
}
# The package layout of pyproject's package-dir, without pip (no build backend needed).
_tree_site() {
    mkdir -p $1/site && cp -r $1/src/exl3_jax $1/site/ && cp -r $1/src/ffi $1/site/exl3_jax/ffi
    cp -r $1/src/models $1/site/exl3_jax/models
}
# cd too: `python3 -m` puts the working directory (this repo) ahead of PYTHONPATH.
_tree_enter() {
    export PYTHONPATH=/tmp/tree_$1/site:$BASE_PYTHONPATH; cd /tmp/tree_$1/site
    python3 -c "import exl3_jax, exl3_jax.ffi as f; print('tree $1:', exl3_jax.__file__, f.__file__)"
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import jax, cutlass; print('jax', jax.__version__, 'cutlass-dsl', cutlass.__version__)" 2>&1 | tail -1
# The device's .git can lag this session's commits (it named 0c08a74 through session 38), so
# the line that identifies the code is a digest of the tracked Python files as they arrived;
# `scripts/gpu_calls/tree_digest.sh` prints the same digest here.
echo "code $(bash scripts/gpu_calls/tree_digest.sh) (git's line, may lag: $(git log -1 --format='%h %s' 2>/dev/null | cut -c1-60))"
t start
# `ncu_kernel TAG REGEX ARGS...`: Nsight Compute of one launch of the kernels matching REGEX in
# `scripts/gpu_probe_linear.py run ARGS` (its second call: the first compiles): source counters
# (warp stalls by SASS line), warp states, scheduler, pipes, memory; the details page's key lines
# and scripts/ncu_source_summary.py's top lines printed, report and summaries in $RES/TAG*.
ncu_kernel() {
    local tag=$1 regex=$2; shift 2
    timeout ${NCU_TIMEOUT:-120} ncu --clock-control none -k regex:"$regex" --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --import-source no -f -o $RES/$tag python3 scripts/gpu_probe_linear.py run "$@" > $RES/${tag}_ncu.log 2>&1
    t "ncu $tag rc=$?"; grep -v "^==PROF==" $RES/${tag}_ncu.log | tail -2 | cut -c1-200
    ncu -i $RES/$tag.ncu-rep --page source --csv --print-source sass > $RES/${tag}_sass.csv 2> /dev/null
    ncu -i $RES/$tag.ncu-rep --page details > $RES/${tag}_details.txt 2>&1
    grep -E "Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Eligible Warps|Active Warps|Block Limit|Achieved Occ|Compute \(SM\) Throughput|Memory Throughput|L2 Hit|highest-utilized|Dynamic Shared" $RES/${tag}_details.txt | cut -c1-130 | head -24
    python3 scripts/ncu_source_summary.py $RES/${tag}_sass.csv --top ${NCU_TOP:-30} > $RES/${tag}_summary.txt 2>&1
    head -c 5000 $RES/${tag}_summary.txt; rm -f $RES/${tag}_sass.csv; save
}
# `ncu_op TAG K N M`: gpu__time_duration of every launch of NCU_CALLS (default 4) calls of the
# K4 mcg linear's op (`scripts/gpu_probe_linear.py run`, the plan auto picks or $EXL3_JAX_PLAN)
# under ncu; the last NCU_LAST (default 8) launches printed, the CSV in $RES/TAG.csv. Callers
# set XLA_FLAGS=--xla_gpu_autotune_level=0 to keep the GEMM autotuner's launches out.
ncu_op() {
  timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv python3 $ROOT/scripts/gpu_probe_linear.py run --k $2 --n $3 --K 4 --codebook mcg --m $4 --calls ${NCU_CALLS:-4} > $RES/$1.csv 2> $RES/$1.err
  t "ncu $1 rc=$?"; python3 - $RES/$1.csv ${NCU_LAST:-8} <<'PY'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))   # after the program's own lines
rows = list(csv.reader(lines[start:]))
ki, vi, ui = (rows[0].index(h) for h in ("Kernel Name", "Metric Value", "Metric Unit"))
print(len(rows) - 1, f"launches profiled; the last {sys.argv[2]} (the last op calls'):")
for r in rows[-int(sys.argv[2]):]:
    print(f"{r[vi]:>12} {r[ui]:<6} {r[ki][:100]}")
PY
  save
}
# The timing steps the calls share: `bench_linear TREE TAG SECONDS` (the issue's two large shapes,
# K 3 and 4, both codebooks, m 1 / 4 / 16) and `bench_moe TREE TAG SECONDS` (the Qwen3 layer,
# m 1..8), in tree TREE, results $RES/TAG.{json,log}.
bench_linear() {
    tree $1
    timeout $3 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16 --out $RES/$2.json > $RES/$2.log 2>&1
    t "bench linear $2 rc=$?"; grep -v -i warn $RES/$2.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -30; save
}
bench_moe() {
    tree $1
    timeout $3 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1,2,4,8 --out $RES/$2.json > $RES/$2.log 2>&1
    t "bench moe $2 rc=$?"; grep -v -i warn $RES/$2.log | tail -8 | cut -c1-160; save
}
# `ab_split_groups TAG M`: packed vs split pairs over 3 token groups (EXL3_JAX_SPLIT_GROUPS 1 | 3,
# twice) in the decode plan, the issue's two large shapes, mcg K3 and K4, m = M.
ab_split_groups() {
    EXL3_JAX_PLAN=decode timeout 80 python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_SPLIT_GROUPS --values '1|3|1|3' --shapes 8192x28672,4096x14336 --K 4,3 --codebooks mcg --m $2 --out $RES/$1.json > $RES/$1.log 2>&1
    t "ab split groups m=$2 rc=$?"; grep '^{' $RES/$1.log | cut -c1-220; save
}
# `ab_rows LOG ENV`: one line per gpu_linear_ab.py row of LOG (k, members, K, codebook, m, the
# value of ENV, us or the error, x bf16).
ab_rows() {
  grep '^{' $1 | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['k'],r['members'],r['K'],r['codebook'],r['m'],repr(r['$2']),r.get('us',r.get('error','')[:80]),r.get('x_bf16',''))"
}
# `ab_ring TAG M SHAPES VALUES [SECONDS]`: decode plans at m = M (a list: 4,8) with
# EXL3_JAX_DECODE_RING set to each of VALUES ('|0,2,0|': default, then 2-step chunks, ...), K 4
# and 3, mcg and mul1, within SECONDS (default 200); one row per value printed, results
# $RES/TAG.{json,log}.
ab_ring() {
  EXL3_JAX_PLAN=decode timeout ${5:-200} python3 scripts/gpu_linear_ab.py --bf16 --env EXL3_JAX_DECODE_RING --values "$4" --shapes $3 --K 4,3 --codebooks mcg,mul1 --m $2 --out $RES/$1.json > $RES/$1.log 2>&1
  t "ab $1 rc=$?"; ab_rows $RES/$1.log EXL3_JAX_DECODE_RING; save
}
# `issue_table TAG` (calls 47, 52): issue #5's table on the card that came: a hardware check of
# the wgmma kinds (one-hot decode, GEMM rows with poisoned outputs at m 33 / 128 / 1000), `bench
# linear` (8192x28672 and 4096x14336, K 3 / 4, mcg / mul1, m 1..4096), `bench moe` (Qwen3-30B-A3B,
# m 1..8) and the e2e decode (Llama-3-8B geometry b1 / b8 against bf16, Qwen3-30B-A3B b1 / b8);
# results $RES/TAG_*.
issue_table() {
  timeout 110 python3 scripts/gpu_validate.py --quick --no-bench --sections decode_exact,gemm --kinds wgmma,wgmma_tight,wgmma_fused --m 33,128,1000 --budget-s 85 --out $RES/${1}_validate.json > $RES/${1}_validate.log 2>&1
  t "validate wgmma rc=$?"; tail -3 $RES/${1}_validate.log | cut -c1-200; save
  timeout 170 python3 -m exl3_jax.cli bench linear --shapes 8192x28672,4096x14336 --K 3,4 --codebooks mcg,mul1 --m 1,4,16,32,128,1024,4096 --out $RES/${1}_linear.json > $RES/${1}_linear.log 2>&1
  t "bench linear rc=$?"; grep -v -i warn $RES/${1}_linear.log | grep -E "^ *(8192|4096)" | cut -c1-110 | head -70; save
  timeout 60 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b --m 1,2,4,8 --out $RES/${1}_moe.json > $RES/${1}_moe.log 2>&1
  t "bench moe rc=$?"; grep -v -i warn $RES/${1}_moe.log | tail -8 | cut -c1-160; save
  (cd scripts && timeout 190 python3 gpu_e2e_decode.py --cases dense:1:512,dense_bf16:1:512,dense:8:64,dense_bf16:8:64,moe:1:512,moe:8:64 --codebook mcg --repeats 3 --budget-s 170 --hard-limit-s 185 --out $RES/${1}_e2e.json > $RES/${1}_e2e.log 2>&1)
  t "e2e rc=$?"; grep -E "tok/s" $RES/${1}_e2e.log | cut -c1-200 | head -8; save
}
# `moe_cluster_ab TAG ARMS`: bench moe Qwen3-30B-A3B and GLM-5.2 TP4, m 1, 2, 4, no baseline,
# one process per arm in the order given (calls 98 / 99): s42 (tree s42, 4bd7dc8), cuts (this
# tree, EXL3_JAX_MOE_CLUSTER=1), here (this tree, clusters on); results $RES/TAG_ARM.{json,log}.
moe_cluster_ab() {
  local tag=$1; shift
  for arm in "$@"; do
    case $arm in
      s42) tree s42; unset EXL3_JAX_MOE_CLUSTER;;
      cuts) tree here; export EXL3_JAX_MOE_CLUSTER=1;;
      here) tree here; export EXL3_JAX_MOE_CLUSTER=auto;;
    esac
    timeout 100 python3 -m exl3_jax.cli bench moe --geometries qwen3-30b-a3b,glm-5.2-tp4 --m 1,2,4 --no-baseline --out $RES/${tag}_$arm.json > $RES/${tag}_$arm.log 2>&1
    t "bench moe $arm rc=$?"; grep -v -i warn $RES/${tag}_$arm.log | grep -E "m=|us" | cut -c1-90 | head -8; save
  done
  unset EXL3_JAX_MOE_CLUSTER; tree here
}
