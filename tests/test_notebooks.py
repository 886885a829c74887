"""The research notebooks: stored without outputs, and executed end to end with nbclient.

01_quickstart gets its model from EXL3_JAX_NOTEBOOK_MODEL: a tiny synthetic EXL3 model with a toy
word-level tokenizer in the default run (does the notebook work at all), the default SmolLM2 model
(``default_model`` fixture) in the slow run, where the answer must name Paris."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from helpers_models import cached_models  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
MODEL_ENV = "EXL3_JAX_NOTEBOOK_MODEL"


def execute(name: str, workdir: Path, timeout: int = 600):
    """Run every cell of notebooks/<name> in a fresh python3 kernel (inheriting os.environ);
    a failing cell raises CellExecutionError with its traceback. Returns the executed notebook."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb


def outputs(nb, kind: str) -> list:
    """All outputs of code cells: the text of 'stream' outputs or the 'image/png' payloads."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if kind == "stream" and out.get("output_type") == "stream":
                found.append(out["text"])
            elif kind == "image/png" and "image/png" in out.get("data", {}):
                found.append(out["data"]["image/png"])
    return found


def test_notebooks_are_stored_without_outputs():
    names = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert names == ["01_quickstart.ipynb", "02_trellis_anatomy.ipynb"]
    for name in names:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, \
                    f"{name} cell {i} has stored outputs: clear them before committing"


def test_trellis_anatomy_runs(tmp_path):
    nb = execute("02_trellis_anatomy.ipynb", tmp_path)
    assert len(outputs(nb, "image/png")) == 3     # histograms, tiles, error vs K
    text = "".join(outputs(nb, "stream"))
    assert text.count("relative MSE") == 6, text


def _toy_tokenizer_model(tmp_path_factory) -> Path:
    """The synthetic llama EXL3 model plus a word-level tokenizer over its 300 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = cached_models("llama", tmp_path_factory)[0]
    model = tmp_path_factory.mktemp("nb") / "model"
    shutil.copytree(src, model)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, 300)})
    for i, word in enumerate("What is the capital of France?".split()):
        vocab[word] = vocab.pop(f"w{10 + i}")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return model


def test_quickstart_runs_on_a_synthetic_model(tmp_path_factory, tmp_path, monkeypatch):
    model = _toy_tokenizer_model(tmp_path_factory)
    monkeypatch.setenv(MODEL_ENV, str(model))
    nb = execute("01_quickstart.ipynb", tmp_path)
    text = "".join(outputs(nb, "stream"))
    assert str(model) in text and "ANSWER:" in text
    assert "LlamaForCausalLM" in text
    assert len(outputs(nb, "image/png")) == 1
    # per-layer table: layers 0 and 1 at K=4, lm_head at K=6 (the synthetic model's rates)
    assert "       0  K=4" in text and "       1  K=4" in text and "lm_head  K=6" in text


@pytest.mark.slow
def test_quickstart_with_default_model_answers_paris(default_model, tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_ENV, str(default_model))
    nb = execute("01_quickstart.ipynb", tmp_path)
    text = "".join(outputs(nb, "stream"))
    answer = text.split("ANSWER:", 1)[1]
    assert "Paris" in answer, answer
    assert len(outputs(nb, "image/png")) == 1
