"""Probe (session 19): the decode kernel on one-hot rows, with and without lax.map / an aliased
NaN init, against decode_trellis. Prints mismatch counts and a few values per variant."""
import jax, jax.numpy as jnp, numpy as np
from exl3_jax.ffi import bench as gb, trellis_gemm as tg
from exl3_jax.ops.plans import select_plan
from exl3_jax.trellis import decode_trellis
k = n = 256
w = gb.random_weight(k, n, 4, "mcg", seed=11)
ref = np.asarray(decode_trellis(w.trellis, "mcg"), np.float32)
eye = jnp.eye(k, dtype=jnp.float16)
for m in (32, 1):
    plan = select_plan(m, k, n, force="decode")
    c = tg._mma_config(w, plan)
    init = jnp.full((c.splits * c.m_pad * c.n,), np.float32(np.nan))
    direct = jax.jit(lambda e: tg.mma_partials(e, w, plan))(eye[:m])
    got = np.asarray(direct).reshape(c.splits, c.m_pad, n)[:, :m].sum(0)
    print(m, "direct", int(np.sum(got != ref[:m])), got[0, :3], ref[0, :3], flush=True)
    aliased = jax.jit(lambda e: tg.mma_partials(e, w, plan, out_init=init))(eye[:m])
    got = np.asarray(aliased).reshape(c.splits, c.m_pad, n)[:, :m].sum(0)
    print(m, "aliased", int(np.sum(got != ref[:m])), got[0, :3], flush=True)
    mapped = jax.jit(lambda E: jax.lax.map(lambda e: tg.mma_partials(e, w, plan, out_init=init),
                                           E))(eye[:2 * m].reshape(2, m, k))
    got = np.asarray(mapped).reshape(2, c.splits, c.m_pad, n)[0, :, :m].sum(0)
    print(m, "lax.map aliased", int(np.sum(got != ref[:m])), got[0, :3], flush=True)
