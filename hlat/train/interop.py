"""`hlat import-hf` / `hlat export-hf`: transformers directories <-> hlat checkpoints."""

from __future__ import annotations

from pathlib import Path

from hlat import HlatError
from hlat.models import build_model, materialize
from hlat.models.hf import read_hf_dir, write_hf_dir
from hlat.train.checkpoint import CONFIG_FILE, load_checkpoint, model_state, resolve_checkpoint, write_checkpoint
from hlat.train.config import Config, load_config


def import_hf(hf_dir: str | Path, out: str | Path) -> Path:
    """Write the weights of a transformers Llama/GPT-NeoX directory as an hlat checkpoint (model only)."""
    out = Path(out)
    if (out / ".metadata").exists():
        raise HlatError(f"{out}: already holds a checkpoint; choose another --out")
    model_cfg, state = read_hf_dir(hf_dir)
    model = build_model(model_cfg)
    model.load_state_dict(state, strict=True, assign=True)  # checks names and shapes against hlat's model
    return write_checkpoint(out, {"model": model_state([model])}, Config(model=model_cfg).to_toml())


def export_hf(ckpt: str | Path, out: str | Path) -> Path:
    """Write an hlat checkpoint (or a run directory's latest) as config.json + model.safetensors."""
    path = resolve_checkpoint(ckpt)
    if not (path / CONFIG_FILE).is_file():
        raise HlatError(f"{path}: has no {CONFIG_FILE}, so its model shape is unknown")
    cfg = load_config(path / CONFIG_FILE)
    model = materialize(build_model(cfg.model), "cpu")
    load_checkpoint(path, [model])
    write_hf_dir(cfg.model, model.state_dict(), out)
    return Path(out)
