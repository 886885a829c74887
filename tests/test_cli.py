"""The exl3-jax command line: inspect on a checkpoint the test writes, and its error path."""

import numpy as np
import pytest

from exl3_jax.cli import main
from exl3_jax.format import Exl3Writer


def test_inspect_prints_table_and_totals(tmp_path, rng, capsys):
    out = tmp_path / "m"
    with Exl3Writer(out, {"architectures": ["LlamaForCausalLM"]}) as w:
        w.add_linear("model.layers.0.mlp.down_proj",
                     rng.integers(-32768, 32768, (16, 8, 48), dtype=np.int16),
                     np.ones(256, np.float16), np.ones(128, np.float16), "mul1")
        w.add_tensor("model.norm.weight", np.ones(128, np.float32))
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.0.mlp.down_proj" in text and "mul1" in text and "256 x 128" in text
    # 256*128 weights at 3 bits = 12288 trellis bytes, plus 2*(256+128) for suh/svh, +4 marker
    bpw = 8 * (12288 + 2 * 384 + 4) / (256 * 128)
    assert f"{bpw:.3f} bits per weight" in text
    assert "1 plain tensors" in text


def test_inspect_reports_bad_checkpoint(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "awq"}}')
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown quant_method 'awq'" in err and "config.json" in err


def test_bench_without_a_gpu_stops_with_a_clear_error(capsys, monkeypatch):
    # CI has no CUDA device: both benchmarks refuse at once (exit 2) and say why and what
    # the CPU alternative is, rather than timing nothing shape by shape.
    import jax
    monkeypatch.delenv("EXL3_JAX_EMULATE", raising=False)
    assert jax.default_backend() == "cpu"
    for what in ("linear", "moe"):
        assert main(["bench", what, "--m", "1"]) == 2
        err = capsys.readouterr().err
        assert "no CUDA device" in err and "backend is cpu" in err and "EXL3_JAX_EMULATE=1" in err


def test_bench_moe_rates_parse_or_say_what_is_wrong(capsys):
    from exl3_jax.ffi import bench
    assert [bench._moe_rates(v) for v in ("4", "2.5", "3+4")] == [(4,), (2.5,), (3, 4)]
    with pytest.raises(SystemExit):
        bench.main_moe(["--K", "3+x"])
    assert "'3+x' is not a rate or rates joined by +" in capsys.readouterr().err


def test_missing_model_and_text_files_are_clear_errors(tmp_path, capsys):
    # No traceback: the path that is missing is named, exit status 2.
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert f"model directory {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["ppl", str(tmp_path / "file"), "--text", "t.txt"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["ppl", str(tmp_path), "--text", str(tmp_path / "absent.txt")]) == 2
    err = capsys.readouterr().err
    assert "exl3-jax ppl: error" in err and "absent.txt" in err
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "out"), "--bits", "4"]) == 2
    assert f"model directory {tmp_path / 'src'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
