"""The README's main job on the built-in default model (built once per test session)."""

import json

from exl3_jax.cli import main
from exl3_jax.format import Exl3Checkpoint
from exl3_jax.quant import default_model as dm


def test_default_model_is_complete_and_records_its_recipe(default_model):
    assert dm.check_manifest(default_model) is None
    qc = json.loads((default_model / "quantization_config.json").read_text())
    assert qc["bits"] == dm.BITS and qc["head_bits"] == dm.HEAD_BITS
    assert qc["encoder"]["mode"] == dm.MODE            # which encoder mode built it
    ckpt = Exl3Checkpoint(default_model)
    ks = {info.key: info.K for info in ckpt.iter_linears()}
    assert len(ks) == 30 * 7 + 1                       # every body linear and the head
    assert ks.pop("lm_head") == dm.HEAD_BITS and set(ks.values()) == {dm.BITS}


def test_generate_without_model_answers_paris(default_model, capsys):
    assert main(["generate", "--prompt", "What is the capital of France?",
                 "--max-new-tokens", "24"]) == 0
    answer = capsys.readouterr().out
    assert "Paris" in answer, answer
