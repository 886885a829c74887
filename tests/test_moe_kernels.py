"""Compile-only CI tests of the grouped Trellis MoE kernels (no GPU here): every case is
jax.export-ed for platforms=["cuda"] with CUTE_DSL_ARCH=sm_90a and sm_120a (one subprocess per
arch, since CuTe DSL reads the arch once per process), which compiles the grouped FC1/FC2
kernels (single-slab and tiered) and the fused glue kernels (rotate_in, activation, combine) and
embeds their cubins. Checked: the export
succeeds, holds moe_gpu's one CuTe custom call (its 5 kernels; sorted plans add the route
packing's call), and its cubins are for the requested SM only. The numerics are validated on
the H200 by scripts/gpu_validate_moe.py."""

from __future__ import annotations

import helpers_sass
import pytest
from helpers_cute import check_rows, last_line_of_script, needs_cutlass

from exl3_jax.ops.moe_plans import moe_plan

# [codebook, K, tokens, plan, E, H, I, top_k(, x_scale, logical I)]: every integer K 2..8 and a
# half rate, each codebook, both plans, every block_m (8, 16, 32, 48, 64), K-splits > 1, unroll
# 1/2/4, the scaled-fp16-operand activation variant and a padded intermediate size.
CASES = [
    ["3inst", 2, 1, "decode", 8, 256, 128, 2],
    ["mcg", 3, 16, "decode", 16, 512, 256, 4],
    ["mul1", 4, 64, "prefill", 8, 256, 256, 4],
    ["mcg", 5, 40, "prefill", 8, 256, 128, 2, True, None],
    ["3inst", 6, 3, "decode", 8, 256, 384, 2, True, 300],
    ["mul1", 7, 80, "prefill", 8, 256, 128, 4],
    ["mcg", 8, 200, "prefill", 8, 256, 128, 2],
    ["mul1", 3.5, 1, "decode", 128, 2048, 768, 8],
]
# Mixed-bitrate layers, each served by one set of launches (the grouped GEMMs carry one k loop
# per tier): two tiers (decode), three tiers with a half rate (decode), prefill blocks (forced:
# on sm_90a auto gives 40 tokens the wgmma plan, WGMMA_CASES).
TIER_CASES = [
    ["mcg:3+mul1:4", 0, 2, None, 8, 256, 128, 2],
    ["mcg:3+3inst:2+mul1:3.5", 0, 3, None, 12, 256, 256, 2],
    ["mcg:4+mul1:5", 0, 40, "prefill", 8, 256, 128, 2],
]


def test_cases_cover_the_plan_parameters():
    plans = [moe_plan(c[2], c[7], c[4], c[5], c[6], kind=c[3]) for c in CASES]
    assert {p.block_m for p in plans} == {8, 16, 32, 48, 64}
    assert {p.kind for p in plans} == {"decode", "prefill"}
    assert {p.packing for p in plans} == {"per_route", "sorted"}   # per-route: FC1 rotates
    gemms = [g for p in plans for g in (p.fc1, p.fc2)]
    assert any(g.splits > 1 for g in gemms)
    assert {g.unroll for g in gemms} >= {1, 2, 4}
    assert {c[1] for c in CASES} >= {2, 3, 4, 5, 6, 7, 8}
    assert {c[0] for c in CASES} == {"3inst", "mcg", "mul1"}


# Local-memory instructions (STL / LDL) over all cases' cubins: the mul1 K = 7 prefill grouped
# GEMM (["mul1", 7, 80, "prefill", ...]) spills one register on sm_90a (one STL, one LDL),
# already on main before session 17 (55c788a). A change in these counts is a new spill (or
# that one fixed): look at the SASS before updating them.
KNOWN_SPILLS = {"sm_90a": 2, "sm_120a": 0}


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_moe_kernels_compile_and_export(arch, tmp_path):
    glue = ["_activation_kernel", "_combine_kernel", "_grouped_mma_kernel",
            "_grouped_mma_kernel"]
    rows = check_rows("exl3_jax.ffi.trellis_moe", CASES + TIER_CASES, arch,
                      env={"CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path)})
    if helpers_sass.nvdisasm() is not None:          # register spills: only the known one
        assert list(tmp_path.glob("*.cubin"))
        spills = helpers_sass.spilling_cubins(tmp_path)
        assert sum(spills.values()) == KNOWN_SPILLS[arch], spills
    for row in rows:
        # rotate_in, FC1, activation, FC2, combine in one custom call; sorted plans pack their
        # routes in one more (ffi/route_pack.py, the default at these sizes).
        # A single-slab per-route plan rotates inside FC1: no rotate_in kernel in the layer.
        plan = moe_plan(row["tokens"], row["top_k"], row["E"], row["H"], row["I"],
                        kind=row["plan"])
        sorted_ = plan.packing == "sorted"
        assert row["calls"] == 1 + sorted_, row
        fused = not sorted_ and not row["tiers"]
        assert row["kernels"] == sorted(glue + ([] if fused else ["_rotate_in_kernel"])
                                        + (["_pack_routes_kernel"] if sorted_ else [])), row


# FC1's rotation shared by a thread-block cluster (EXL3_JAX_MOE_CLUSTER=auto; off by default
# until timed): clusters of 2 (2 row blocks) and 8 (the Qwen3-30B-A3B layer), both arches.
CLUSTER_CASES = [["3inst", 2, 1, "decode", 8, 256, 128, 2],
                 ["mul1", 3.5, 1, "decode", 128, 2048, 768, 8]]


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_moe_cluster_rotation_compiles_without_spills(arch, tmp_path):
    check_rows("exl3_jax.ffi.trellis_moe", CLUSTER_CASES, arch,
               env={"CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path),
                    "EXL3_JAX_MOE_CLUSTER": "auto"})
    if helpers_sass.nvdisasm() is None:
        pytest.skip("nvdisasm not installed: the cubins are not inspected")
    cubins = sorted(tmp_path.glob("*.cubin"))
    assert len(cubins) == len(CLUSTER_CASES)
    assert not helpers_sass.spilling_cubins(tmp_path)
    for cubin in cubins:     # the cluster barrier's arrive and wait, distributed stores
        ops = [ins.split()[0] for _, ins in helpers_sass.disassemble(str(cubin))]
        assert {"UCGABAR_ARV", "UCGABAR_WAIT"} <= set(ops), cubin.name
        assert sum(op.startswith("ST.E.128") for op in ops) >= 2, cubin.name


# The wgmma plan (Hopper only: sm_90a): blocks of 128, 64 and 32 rows, each codebook, a half
# rate, x_scale, a padded intermediate size, and a two-tier layer (one launch per tier).
WGMMA_CASES = [
    ["mcg", 4, 300, "wgmma", 8, 256, 256, 2],
    ["mul1", 3, 100, "wgmma", 8, 256, 128, 2],
    ["3inst", 2, 40, "wgmma", 8, 256, 256, 2, True, 200],
    ["mul1", 2.5, 200, "wgmma", 8, 256, 128, 2],
    ["mcg:3+mul1:4", 0, 40, "wgmma", 8, 256, 128, 2],
]


@needs_cutlass
def test_moe_wgmma_plan_compiles_for_hopper(tmp_path):
    rows = check_rows("exl3_jax.ffi.trellis_moe", WGMMA_CASES, "sm_90a",
                      env={"CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path)})
    plans = [moe_plan(c[2], c[7], c[4], c[5], c[6], kind=c[3], hopper=True) for c in WGMMA_CASES]
    assert {p.kind for p in plans} == {"wgmma"} and {p.block_m for p in plans} == {32, 64, 128}
    if helpers_sass.nvdisasm() is not None:
        assert list(tmp_path.glob("*.cubin"))
        assert helpers_sass.spilling_cubins(tmp_path) == {}
    for row in rows:      # both GEMMs on the grouped wgmma kernel (per tier), in one custom call
        launches = len(row["tiers"] or [None])     # (and the route packing in one more)
        assert row["calls"] == 2, row
        assert row["kernels"] == ["_activation_kernel", "_combine_kernel", "_pack_routes_kernel",
                                  "_rotate_in_kernel"] \
            + ["_trellis_wgmma_kernel"] * (2 * launches), row


# The route-packing kernel (ffi/route_pack.py): one round per warp with ranks in registers,
# eight and 32 (ranks through route_row, past REGISTER_ROUNDS) at 128 / 256 experts, 1000
# experts.
PACK_EXPORT = """
import jax, jax.numpy as jnp
from jax import export
from exl3_jax.ffi import aot
from exl3_jax.ffi.route_pack import pack_routes_gpu
n = 0
for T, top_k, E, bm in ((8, 8, 128, 8), (1024, 8, 128, 64), (4096, 8, 256, 128), (256, 4, 1000, 8)):
    exp = export.export(jax.jit(lambda i: pack_routes_gpu(i, E, bm)), platforms=["cuda"],
                        disabled_checks=aot.disabled_checks())(
        jax.ShapeDtypeStruct((T, top_k), jnp.int32))
    n += aot.CUSTOM_CALL_PREFIX in exp.mlir_module()
print(n)
"""


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_route_packing_kernel_compiles_without_spills(arch, tmp_path):
    keep = {"CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path)}
    assert last_line_of_script(PACK_EXPORT, arch, env=keep) == "4"
    if helpers_sass.nvdisasm() is not None:
        assert len(list(tmp_path.glob(f"*.{arch}.cubin"))) == 4
        assert helpers_sass.spilling_cubins(tmp_path) == {}


DISPATCH_EXPORT = """
import importlib
import jax, jax.numpy as jnp
from jax import export
from exl3_jax.ffi import aot
from exl3_jax.trellis import Exl3Weight
moe_ops = importlib.import_module("exl3_jax.ops.moe")

def f(x, ids, w, t3, s3, v3, t4, s4, v4, u3, u4, tier, slot):
    tiers = [(Exl3Weight(t3, s3, v3, None, "mcg", 3, 256, 128),
              Exl3Weight(t4, s4, v4, None, "mcg", 3, 128, 256)),
             (Exl3Weight(u3, s3, v3, None, "mul1", 4, 256, 128),
              Exl3Weight(u4, s4, v4, None, "mul1", 4, 128, 256))]
    return moe_ops.moe_tiered(x, ids, w, tiers, tier, slot, backend="gpu")

sds = jax.ShapeDtypeStruct
f16 = jnp.float16
exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=aot.disabled_checks())(
    sds((5, 200), jnp.bfloat16), sds((5, 2), jnp.int32), sds((5, 2), jnp.float32),
    sds((2, 4, 16, 8, 48), jnp.int16), sds((2, 4, 256), f16), sds((2, 4, 128), f16),
    sds((4, 8, 16, 48), jnp.int16), sds((4, 128), f16), sds((4, 256), f16),
    sds((2, 4, 16, 8, 64), jnp.int16), sds((4, 8, 16, 64), jnp.int16),
    sds((8,), jnp.int32), sds((8,), jnp.int32))
back = export.deserialize(exp.serialize())
print(exp.mlir_module().count(aot.CUSTOM_CALL_PREFIX), back.out_avals[0].shape)
"""


@needs_cutlass
def test_tiered_dispatch_lowers_for_cuda():
    # The ops-level dispatch (two K tiers, narrower input 200 -> 256) exports for CUDA and
    # survives serialization: both tiers run in one set of launches, so the module holds one CuTe
    # custom call for the layer (rotate_in, FC1, activation, FC2, combine) however many tiers
    # there are, and one for its route packing (10 routes on 8 experts: a sorted plan).
    assert last_line_of_script(DISPATCH_EXPORT) == "2 (5, 256)"
