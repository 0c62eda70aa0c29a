"""`hlat import-hf` / `hlat export-hf`: transformers directories <-> hlat checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers

from hlat import HlatError
from hlat.checkpoint.durable import write_checkpoint
from hlat.checkpoint.state import model_state
from hlat.config.job import Config
from hlat.data.tokenizer import Tokenizer, tokenizer_file_in
from hlat.models import build_model
from hlat.models.hf import read_hf_dir, write_hf_dir
from hlat.tools.inference import load_trained_model, saved_tokenizer


def import_hf(hf_dir: str | Path, out: str | Path) -> tuple[Path, str]:
    """Write the weights of a transformers Llama/GPT-NeoX directory as an hlat checkpoint (model only), with the
    directory's tokenizer beside them, where `hlat generate` and `hlat eval` find it. Returns the checkpoint and a
    note on the tokenizer."""
    out = Path(out)
    if (out / ".metadata").exists():
        raise HlatError(f"{out}: already holds a checkpoint; choose another --out")
    model_cfg, state = read_hf_dir(hf_dir)
    model = build_model(model_cfg)
    model.load_state_dict(state, strict=True, assign=True)  # checks names and shapes against hlat's model
    written = write_checkpoint(out, {"model": model_state([model])}, Config(model=model_cfg).to_toml())
    return written, _copy_tokenizer(Path(hf_dir), written)


def _copy_tokenizer(hf_dir: Path, out: Path) -> str:
    """Copy the tokenizer file hlat reads from `hf_dir` (tokenizer.json first; GPT-2's vocab.bpe with its
    encoder.json) into the checkpoint `out` (outside its manifest: the weights are what it verifies)."""
    found = tokenizer_file_in(hf_dir)
    if found is None:
        return f"no tokenizer in {hf_dir}: give hlat generate and hlat eval --tokenizer"
    for file in [found, *([found.with_name("encoder.json")] if found.name == "vocab.bpe" else [])]:
        shutil.copyfile(file, out / file.name)
    return f"with its tokenizer, {found.name}"


def export_hf(ckpt: str | Path, out: str | Path) -> tuple[Path, str]:
    """Write an hlat checkpoint (or a run directory's latest) as a transformers directory: config.json,
    generation_config.json, safetensors weights and, when the run's tokenizer has a transformers form, its
    tokenizer files. Returns the directory and a note on the tokenizer."""
    path, cfg, model = load_trained_model(ckpt)
    tokenizer = saved_tokenizer(path)
    tokens = _special_tokens(tokenizer) if tokenizer else {}
    write_hf_dir(cfg.model, model.state_dict(), out, special_tokens=tokens)
    return Path(out), _write_tokenizer_files(tokenizer, Path(out), cfg.model.max_seq_len)


def _special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    # hlat's loader separates documents with EOS and adds no BOS: EOS doubles as BOS, as in GPT-2 and GPT-NeoX
    return {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id}


def _write_tokenizer_files(tokenizer: Tokenizer | None, out: Path, max_len: int) -> str:
    if tokenizer is None:
        return "no tokenizer beside the checkpoint: none exported"
    if tokenizer.kind != "hf":
        return (
            f"the run's {tokenizer.kind} tokenizer is not exported (only tokenizer.json has a form every "
            f"transformers version loads); copy it beside the model yourself"
        )
    tokenizer.save(out)
    eos = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")).id_to_token(tokenizer.eos_id)
    special = {"bos_token": eos, "eos_token": eos}
    # model_input_names: transformers 4 would otherwise add token_type_ids, which generate() refuses
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": max_len,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return f"tokenizer.json with bos = eos = {eos!r} (id {tokenizer.eos_id})"
