"""Rank-sliced (hybrid_tr3_tail) MoE checkpoints: metadata validation, names, per-rank loading.

Every test writes its own small checkpoint: full random EXL3 experts (random int16 trellis is a
valid encoding) cut into TP rank slices on 128-aligned boundaries (gate/up by output columns,
down by input rows), so that the loaded, dequantized rank slices can be checked against the full
tensors they were cut from.
"""

from __future__ import annotations

import copy
import json

import jax
import numpy as np
import pytest

from exl3_jax.format import Exl3FormatError, Exl3Writer, TensorStore
from exl3_jax.format.errors import CodebookMarkerError, MissingTensorError, TensorShapeError
from exl3_jax.format import rank_sliced as rs
from exl3_jax.format.spec import marker_as_int32
from exl3_jax.trellis import dequantize

H, I, E, TP = 256, 256, 4, 2          # I_r = 128 per rank
I_R = I // TP
LAYERS = (1, 2)
SHARED_SCHEMA = "model.layers.{L}.mlp.experts.shared_h.{proj}.rank{r}.{suh|svh}"

_dequantize = jax.jit(dequantize, static_argnums=3)


def good_meta(**changes) -> dict:
    meta = {"format": "exl3-trellis", "bits": 3, "codebook": "mcg", "experts_per_layer": E,
            "moe_layers": [LAYERS[0], LAYERS[-1]], "tensor_schema": rs.TENSOR_SCHEMA, "tp": TP,
            "mcg_multiplier": 3417055213, "exllamav3_version": "0.0.43",
            "hessian": "ldlq-calibrated"}
    meta.update(changes)
    return meta


def full_experts(rng, ks_by_layer, *, shared_h=False):
    """{(layer, proj): (trellis [E,...], suh [E,k], svh [E,n])} of full (unsliced) experts.

    With shared_h the hidden-side vector (gate/up suh, down svh) is one row per (layer, proj)."""
    full = {}
    for L, ks in ks_by_layer.items():
        for proj in rs.PROJECTIONS:
            k, n = (H, I) if proj != "down_proj" else (I, H)
            trellis = [rng.integers(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=np.int16)
                       for K in ks]
            suh = (rng.standard_normal((E, k)) * 0.1).astype(np.float16)
            svh = (rng.standard_normal((E, n)) * 0.1).astype(np.float16)
            if shared_h and proj == "down_proj":
                svh[:] = svh[0]
            elif shared_h:
                suh[:] = suh[0]
            full[L, proj] = (trellis, suh, svh)
    return full


def rank_slice(proj, trellis, suh, svh, r):
    """Spec 8: gate/up keep columns [r*I_R, (r+1)*I_R); down keeps those input rows."""
    c = slice(r * I_R, (r + 1) * I_R)
    t = slice(c.start // 16, c.stop // 16)
    if proj == "down_proj":
        return trellis[t], suh[c], svh
    return trellis[:, t], suh, svh[c]


def rank_tensors(full, *, shared_h=False) -> dict[str, np.ndarray]:
    """Stored tensors of a rank-sliced checkpoint cut from ``full``, plus a pass-through tensor."""
    out = {"model.embed_tokens.weight": np.ones((8, H), np.float16),
           "model.layers.0.mlp.gate_proj.weight": np.ones((I, H), np.float16)}
    mcg = np.array(marker_as_int32("mcg"), np.int32)
    for (L, proj), (trellis, suh, svh) in full.items():
        for r in range(TP):
            for e in range(E):
                t, su, sv = rank_slice(proj, trellis[e], suh[e], svh[e], r)
                vectors = {"suh": su, "svh": sv}
                if shared_h:
                    side = rs.HIDDEN_SIDE[proj]
                    row = vectors.pop(side)
                    out[rs.shared_h_tensor_name(SHARED_SCHEMA, L, proj, r, side)] = row
                out[rs.rank_tensor_name(L, e, proj, r, "trellis")] = t
                for field, v in vectors.items():
                    out[rs.rank_tensor_name(L, e, proj, r, field)] = v
                out[rs.rank_tensor_name(L, e, proj, r, "mcg")] = mcg
    return out


def write_checkpoint(path, tensors, meta, bitmap=None):
    with Exl3Writer(path, {"architectures": ["Glm4MoeForCausalLM"], "hidden_size": H,
                           "n_routed_experts": E, rs.METADATA_KEY: meta}) as w:
        for name, array in tensors.items():
            w.add_tensor(name, array)
    if bitmap is not None:
        (path / "tier_bitmap.json").write_text(json.dumps(bitmap))
    return path


@pytest.fixture
def uniform_ckpt(tmp_path, rng):
    full = full_experts(rng, {L: (3,) * E for L in LAYERS})
    return write_checkpoint(tmp_path / "ckpt", rank_tensors(full), good_meta()), full


def dense(stack) -> np.ndarray:
    """Dequantized weights [E, k, n] of a uniform ExpertStack (float64)."""
    w = stack.uniform
    return np.asarray(_dequantize(w.trellis, w.suh, w.svh, w.codebook), np.float64)


def dense_full(trellis_list, suh, svh) -> np.ndarray:
    return np.stack([np.asarray(_dequantize(t, s, v, "mcg"), np.float64)
                     for t, s, v in zip(trellis_list, suh, svh)])


# -------------------------------------------------------------------------------------------
# metadata

def test_parse_uniform_and_mixed():
    cfg = rs.parse_rank_sliced_config({rs.METADATA_KEY: good_meta(bits=4.0)})
    assert (cfg.tp, cfg.experts_per_layer, cfg.moe_layers, cfg.bits, cfg.k_values) == \
        (TP, E, (1, 2), 4, (4,))
    assert cfg.rotation_layout == "per_expert_v1" and cfg.bits_per_expert is None
    assert list(cfg.layers) == [1, 2] and cfg.is_moe_layer(2) and not cfg.is_moe_layer(0)
    mixed = rs.parse_rank_sliced_config({rs.METADATA_KEY: good_meta(
        bits="mixed", k_values=[4, 3], bits_per_expert="tier_bitmap.json:k")})
    assert mixed.k_values == (3, 4) and mixed.bits_per_expert == ("tier_bitmap.json", "k")
    shared = rs.parse_rank_sliced_config({rs.METADATA_KEY: good_meta(
        rotation_layout="shared_h_v1", shared_h_tensor_schema=SHARED_SCHEMA)})
    assert shared.rotation_layout == "shared_h_v1"
    assert rs.parse_rank_sliced_config({"quantization_config": {}}) is None
    assert rs.is_rank_sliced({rs.METADATA_KEY: good_meta()})
    assert not rs.is_rank_sliced({rs.METADATA_KEY: good_meta(format="nvfp4")})


def _set(**kv):
    return lambda m: {**m, **kv}


def _drop(key):
    return lambda m: {k: v for k, v in m.items() if k != key}


_MIXED = dict(bits="mixed", k_values=[3, 4], bits_per_expert="tier_bitmap.json:k")

BAD_METADATA = {
    "not_an_object": (lambda m: ["exl3-trellis"], "must be an object"),
    "format_missing": (_drop("format"), r"format is required"),
    "format_other": (_set(format="exl3"), r"format is 'exl3'.*'exl3-trellis'"),
    "bits_missing": (_drop("bits"), r"bits is required"),
    "bits_fractional": (_set(bits=3.5), r"bits = 3\.5 is not integral"),
    "bits_too_low": (_set(bits=2), r"bits = 2 is outside"),
    "bits_too_high": (_set(bits=7), r"bits = 7 is outside"),
    "bits_bool": (_set(bits=True), r"bits must be a number"),
    "bits_other_string": (_set(bits="three"), r"bits is 'three'.*'mixed'"),
    "mixed_without_k_values": (lambda m: _drop("k_values")({**m, **_MIXED}), r"k_values"),
    "mixed_empty_k_values": (_set(**{**_MIXED, "k_values": []}), r"k_values"),
    "mixed_k_values_outside_3_to_6": (_set(**{**_MIXED, "k_values": [3, 8]}),
                                      r"k_values entry = 8 is outside"),
    "mixed_without_bits_per_expert": (lambda m: _drop("bits_per_expert")({**m, **_MIXED}),
                                      r"bits_per_expert is None"),
    "mixed_bits_per_expert_without_field": (
        _set(**{**_MIXED, "bits_per_expert": "tier_bitmap.json"}), r"'file\.json:field'"),
    "mixed_bits_per_expert_outside_repo": (
        _set(**{**_MIXED, "bits_per_expert": "../tier_bitmap.json:k"}), r"inside the checkpoint"),
    "codebook_missing": (_drop("codebook"), r"codebook is required"),
    "codebook_mul1": (_set(codebook="mul1"), r"MCG codebook"),
    "experts_missing": (_drop("experts_per_layer"), r"experts_per_layer is required"),
    "experts_zero": (_set(experts_per_layer=0), r"experts_per_layer must be a positive"),
    "experts_float": (_set(experts_per_layer=4.0), r"experts_per_layer must be a positive"),
    "moe_layers_missing": (_drop("moe_layers"), r"moe_layers is required"),
    "moe_layers_reversed": (_set(moe_layers=[2, 1]), r"moe_layers \[2, 1\] is reversed"),
    "moe_layers_one_entry": (_set(moe_layers=[1]), r"moe_layers must be \[first, last\]"),
    "moe_layers_negative": (_set(moe_layers=[-1, 2]), r"moe_layers must be \[first, last\]"),
    "tensor_schema_missing": (_drop("tensor_schema"), r"tensor_schema is required"),
    "tensor_schema_other": (
        _set(tensor_schema="model.layers.{L}.mlp.experts.{E}.{proj}.{trellis|suh|svh|mcg}"),
        r"tensor_schema is .* only"),
    "tp_missing": (_drop("tp"), r"tp is required"),
    "tp_zero": (_set(tp=0), r"tp must be a positive integer"),
    "tp_string": (_set(tp="2"), r"tp must be a positive integer"),
    "rotation_layout_unknown": (_set(rotation_layout="implicit_magic"),
                                r"rotation_layout 'implicit_magic' is not supported"),
    "shared_h_without_schema": (_set(rotation_layout="shared_h_v1"),
                                r"shared_h_tensor_schema is missing"),
    "shared_h_schema_without_placeholders": (
        _set(rotation_layout="shared_h_v1", shared_h_tensor_schema="model.shared.suh"),
        r"must contain \{L\}"),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_bad_metadata_is_rejected(case):
    mutate, pattern = BAD_METADATA[case]
    config = {rs.METADATA_KEY: mutate(copy.deepcopy(good_meta()))}
    with pytest.raises(rs.RankSlicedConfigError, match=pattern) as info:
        rs.parse_rank_sliced_config(config, file="config.json")
    assert isinstance(info.value, Exl3FormatError) and "config.json" in str(info.value)


# -------------------------------------------------------------------------------------------
# names

def test_name_normalisation_keeps_only_the_local_rank():
    n = "model.layers.3.mlp.experts.5.gate_proj"
    assert rs.normalize_rank_sliced_name(f"{n}.rank2.trellis", 2) == f"{n}.trellis"
    assert rs.normalize_rank_sliced_name(f"{n}.rank2.mcg", 2) == f"{n}.mcg"
    assert rs.normalize_rank_sliced_name(f"{n}.rank1.suh", 2) is None
    assert rs.normalize_rank_sliced_name(f"{n}.rank12.svh", 1) is None
    for other in ("model.embed_tokens.weight", "model.layers.3.mlp.gate.weight",
                  f"{n}.rank2.weight", "lm_head.trellis"):
        assert rs.normalize_rank_sliced_name(other, 2) == other
    assert rs.rank_tensor_name(3, 5, "down_proj", 1, "svh") == \
        "model.layers.3.mlp.experts.5.down_proj.rank1.svh"
    assert rs.shared_h_tensor_name(SHARED_SCHEMA, 4, "up_proj", 3, "suh") == \
        "model.layers.4.mlp.experts.shared_h.up_proj.rank3.suh"


def test_checkpoint_names_per_rank(uniform_ckpt):
    path, _ = uniform_ckpt
    for r in range(TP):
        names = set(rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=r).names())
        assert not any(".rank" in n for n in names)
        assert {"model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight",
                "model.layers.2.mlp.experts.3.down_proj.trellis"} <= names
        assert len(names) == 2 + len(LAYERS) * E * 3 * 4


# -------------------------------------------------------------------------------------------
# loading

def test_each_rank_loads_only_its_own_slice(uniform_ckpt, monkeypatch):
    path, full = uniform_ckpt
    read_names = []
    original = TensorStore.read
    monkeypatch.setattr(TensorStore, "read",
                        lambda self, name: read_names.append(name) or original(self, name))
    ckpt = rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=1, num_experts=E)
    layer = ckpt.load_layer(2)
    assert read_names and all(".rank1." in n for n in read_names)
    down = layer["down_proj"].uniform
    assert down.trellis.shape == (E, I_R // 16, H // 16, 48)
    assert down.suh.shape == (E, I_R) and down.svh.shape == (E, H)
    trellis, suh, svh = full[2, "down_proj"]
    for e in range(E):
        t, su, sv = rank_slice("down_proj", trellis[e], suh[e], svh[e], 1)
        np.testing.assert_array_equal(np.asarray(down.trellis[e]), t)
        np.testing.assert_array_equal(np.asarray(down.suh[e]), su)
        np.testing.assert_array_equal(np.asarray(down.svh[e]), sv)
    gate = layer["gate_proj"].uniform
    assert gate.trellis.shape == (E, H // 16, I_R // 16, 48) and gate.codebook == "mcg"
    assert gate.K == 3 and layer["gate_proj"].expert_slot == (0, 1, 2, 3)


def test_dequantized_rank_slices_assemble_the_full_experts(uniform_ckpt):
    path, full = uniform_ckpt
    ranks = [rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=r).load_layer(1) for r in range(TP)]
    for proj, axis in (("gate_proj", 2), ("up_proj", 2), ("down_proj", 1)):
        assembled = np.concatenate([dense(layer[proj]) for layer in ranks], axis=axis)
        want = dense_full(*full[1, proj])
        np.testing.assert_allclose(assembled, want, rtol=1e-6, atol=1e-7 * np.abs(want).max())
    # and the MoE MLP of one expert: sum over ranks of down_r(silu(gate_r x) * up_r x)
    x = np.random.default_rng(0).standard_normal((3, H))
    e = 2
    got = sum((lambda g, u, d: ((x @ g) / (1 + np.exp(-(x @ g))) * (x @ u)) @ d)(
        dense(layer["gate_proj"])[e], dense(layer["up_proj"])[e], dense(layer["down_proj"])[e])
        for layer in ranks)
    G, U, D = (dense_full(*full[1, p])[e] for p in rs.PROJECTIONS)
    want = ((x @ G) / (1 + np.exp(-(x @ G))) * (x @ U)) @ D
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * np.abs(want).max())


def test_mixed_bits_load_one_stack_per_tier(tmp_path, rng):
    ks = {1: (3, 4, 4, 3), 2: (4, 4, 4, 4)}
    full = full_experts(rng, ks)
    meta = good_meta(bits="mixed", k_values=[3, 4], bits_per_expert="tier_bitmap.json:k")
    bitmap = {str(L): {"k": list(v), "note": "x"} for L, v in ks.items()}
    path = write_checkpoint(tmp_path / "ckpt", rank_tensors(full), meta, bitmap)
    ckpt = rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=0)
    assert ckpt.expert_bits == ks
    up = ckpt.load_experts(1, "up_proj")
    assert sorted(up.tiers) == [3, 4] and up.expert_k == (3, 4, 4, 3)
    assert up.expert_slot == (0, 0, 1, 1)
    assert up.tiers[3].trellis.shape == (2, H // 16, I_R // 16, 48)
    assert up.tiers[4].trellis.shape == (2, H // 16, I_R // 16, 64)
    trellis, suh, svh = full[1, "up_proj"]
    for e in range(E):
        w = up.expert(e)
        t, su, sv = rank_slice("up_proj", trellis[e], suh[e], svh[e], 0)
        assert w.K == ks[1][e]
        np.testing.assert_array_equal(np.asarray(w.trellis), t)
        np.testing.assert_array_equal(np.asarray(w.svh), sv)
    with pytest.raises(ValueError, match="2 K tiers"):
        up.uniform
    assert ckpt.load_experts(2, "down_proj").uniform.K == 4


def test_tail_tr3_quirk_means_all_experts_k3(tmp_path, rng):
    ks = {1: (3,) * E, 2: (3, 4, 3, 4)}
    full = full_experts(rng, ks)
    meta = good_meta(bits="mixed", k_values=[3, 4], bits_per_expert="tier_bitmap.json:k")
    bitmap = {"1": {"tail_tr3": [True] * E}, "2": {"k": [3, 4, 3, 4]}}
    path = write_checkpoint(tmp_path / "ckpt", rank_tensors(full), meta, bitmap)
    ckpt = rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=1)
    assert ckpt.expert_bits == ks
    assert ckpt.load_experts(1, "gate_proj").uniform.K == 3


def test_shared_h_broadcasts_the_hidden_side_row(tmp_path, rng):
    full = full_experts(rng, {L: (3,) * E for L in LAYERS}, shared_h=True)
    meta = good_meta(rotation_layout="shared_h_v1", shared_h_tensor_schema=SHARED_SCHEMA)
    path = write_checkpoint(tmp_path / "ckpt", rank_tensors(full, shared_h=True), meta)
    for r in range(TP):
        layer = rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=r).load_layer(2)
        for proj in rs.PROJECTIONS:
            w = layer[proj].uniform
            trellis, suh, svh = full[2, proj]
            hidden = w.suh if proj != "down_proj" else w.svh
            row = suh[0] if proj != "down_proj" else svh[0]
            np.testing.assert_array_equal(np.asarray(hidden), np.broadcast_to(row, (E, H)))
            want = np.stack([rank_slice(proj, trellis[e], suh[e], svh[e], r)[0]
                             for e in range(E)])
            np.testing.assert_array_equal(np.asarray(w.trellis), want)
    ranks = [rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=r).load_layer(1) for r in range(TP)]
    assembled = np.concatenate([dense(layer["down_proj"]) for layer in ranks], axis=1)
    want = dense_full(*full[1, "down_proj"])
    np.testing.assert_allclose(assembled, want, rtol=1e-6, atol=1e-7 * np.abs(want).max())


# -------------------------------------------------------------------------------------------
# checkpoint-level rejections (one test per case)

def test_runtime_tp_mismatch_is_rejected(uniform_ckpt):
    path, _ = uniform_ckpt
    with pytest.raises(rs.TensorParallelMismatchError, match=r"sliced for tp=2 .* is 4"):
        rs.RankSlicedCheckpoint(path, tp=4, tp_rank=0)
    with pytest.raises(rs.TensorParallelMismatchError, match=r"sliced for tp=2 .* is 1"):
        rs.RankSlicedCheckpoint(path, tp=1, tp_rank=0)


def test_tp_rank_out_of_range_is_rejected(uniform_ckpt):
    with pytest.raises(rs.TensorParallelMismatchError, match=r"tp_rank 2 is outside \[0, 2\)"):
        rs.RankSlicedCheckpoint(uniform_ckpt[0], tp=TP, tp_rank=2)


def test_model_expert_count_mismatch_is_rejected(uniform_ckpt):
    with pytest.raises(rs.RankSlicedConfigError, match=r"experts_per_layer is 4 .* has 8"):
        rs.RankSlicedCheckpoint(uniform_ckpt[0], tp=TP, tp_rank=0, num_experts=8)


def test_config_without_metadata_is_rejected(tmp_path):
    path = write_checkpoint(tmp_path / "plain", {"w": np.zeros(4, np.float16)},
                            good_meta())
    config = json.loads((path / "config.json").read_text())
    del config[rs.METADATA_KEY]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(rs.RankSlicedConfigError, match="no hybrid_tr3_tail"):
        rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=0)


def test_non_moe_layer_is_rejected(uniform_ckpt):
    ckpt = rs.RankSlicedCheckpoint(uniform_ckpt[0], tp=TP, tp_rank=0)
    with pytest.raises(rs.RankSlicedConfigError, match=r"layer 0 is not an EXL3 MoE layer"):
        ckpt.load_experts(0, "gate_proj")


MIXED_META = good_meta(bits="mixed", k_values=[3, 4], bits_per_expert="tier_bitmap.json:k")

BAD_BITMAPS = {
    "missing_file": (None, r"tier bitmap 'tier_bitmap\.json' .* is missing"),
    "not_an_object": ([3, 3, 3, 3], r"must be a JSON object"),
    "layer_missing": ({"1": {"k": [3] * E}}, r"no entry for MoE layer 2"),
    "wrong_length": ({"1": {"k": [3] * E}, "2": {"k": [3] * (E - 1)}},
                     r"layer 2 must list one K per expert \(4\)"),
    "undeclared_k": ({"1": {"k": [3] * E}, "2": {"k": [3, 5, 3, 3]}},
                     r"layer 2 expert 1 has K=5, not among the declared k_values \(3, 4\)"),
    "k_outside_3_to_6": ({"1": {"k": [3] * E}, "2": {"k": [3, 2, 3, 3]}},
                         r"K of layer 2 expert 1 = 2 is outside"),
    "no_field_no_tail_tr3": ({"1": {"k": [3] * E}, "2": {"bits": [3] * E}},
                             r"neither 'k' nor 'tail_tr3'"),
}


@pytest.mark.parametrize("case", list(BAD_BITMAPS))
def test_bad_tier_bitmap_is_rejected(tmp_path, case):
    bitmap, pattern = BAD_BITMAPS[case]
    path = write_checkpoint(tmp_path / "ckpt", {"w": np.zeros(4, np.float16)}, MIXED_META,
                            bitmap)
    with pytest.raises(rs.RankSlicedConfigError, match=pattern) as info:
        rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=0)
    assert "tier_bitmap.json" in str(info.value)


def _tampered(tmp_path, rng, change, meta=None, *, shared_h=False):
    full = full_experts(rng, {L: (3,) * E for L in LAYERS}, shared_h=shared_h)
    tensors = rank_tensors(full, shared_h=shared_h)
    change(tensors)
    return write_checkpoint(tmp_path / "ckpt", tensors, meta or good_meta())


def test_missing_rank_slice_is_rejected(tmp_path, rng):
    name = rs.rank_tensor_name(2, 1, "up_proj", 1, "trellis")
    path = _tampered(tmp_path, rng, lambda t: t.pop(name))
    rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=0).load_layer(2)      # rank 0 is complete
    with pytest.raises(MissingTensorError, match=r"rank 1 slice is missing") as info:
        rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=1).load_layer(2)
    assert name in str(info.value)


def test_trellis_k_disagreeing_with_metadata_is_rejected(tmp_path, rng):
    path = _tampered(tmp_path, rng, lambda t: None, good_meta(bits=4))
    with pytest.raises(TensorShapeError, match=r"K=3 but the metadata says K=4"):
        rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=0).load_experts(1, "gate_proj")


def test_expert_without_mcg_marker_is_rejected(tmp_path, rng):
    name = rs.rank_tensor_name(1, 0, "gate_proj", 0, "mcg")
    path = _tampered(tmp_path, rng, lambda t: t.pop(name))
    with pytest.raises(CodebookMarkerError, match=r"must carry the mcg marker.*3inst"):
        rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=0).load_experts(1, "gate_proj")


def test_wrong_mcg_marker_value_is_rejected(tmp_path, rng):
    name = rs.rank_tensor_name(1, 3, "down_proj", 0, "mcg")
    path = _tampered(tmp_path, rng, lambda t: t.__setitem__(name, np.array(7, np.int32)))
    with pytest.raises(CodebookMarkerError, match=r"non-standard mcg multiplier"):
        rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=0).load_experts(1, "down_proj")


def test_experts_with_different_shapes_are_rejected(tmp_path, rng):
    def widen(t):
        for f, shape in (("trellis", (H // 16, 16, 48)), ("svh", (256,))):
            t[rs.rank_tensor_name(1, 2, "gate_proj", 0, f)] = np.zeros(shape, t[
                rs.rank_tensor_name(1, 2, "gate_proj", 0, f)].dtype)
    path = _tampered(tmp_path, rng, widen)
    with pytest.raises(TensorShapeError, match=r"different \(k, n\)"):
        rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=0).load_experts(1, "gate_proj")


SHARED_META = good_meta(rotation_layout="shared_h_v1", shared_h_tensor_schema=SHARED_SCHEMA)


def test_shared_h_missing_shared_row_is_rejected(tmp_path, rng):
    name = rs.shared_h_tensor_name(SHARED_SCHEMA, 2, "down_proj", 0, "svh")
    path = _tampered(tmp_path, rng, lambda t: t.pop(name), SHARED_META, shared_h=True)
    with pytest.raises(MissingTensorError, match=r"shared hidden-side row is missing") as info:
        rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=0).load_experts(2, "down_proj")
    assert name in str(info.value)


def test_shared_h_with_per_expert_hidden_vector_is_rejected(tmp_path, rng):
    name = rs.rank_tensor_name(1, 0, "gate_proj", 1, "suh")
    path = _tampered(tmp_path, rng, lambda t: t.__setitem__(name, np.ones(H, np.float16)),
                     SHARED_META, shared_h=True)
    with pytest.raises(TensorShapeError, match=r"hidden-side suh once per"):
        rs.RankSlicedCheckpoint(path, tp=TP, tp_rank=1).load_experts(1, "gate_proj")
