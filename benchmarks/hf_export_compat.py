"""Does an `hlat export-hf` directory load as the same model in other transformers versions?

For a tiny Llama (grouped-query attention) and a tiny GPT-NeoX (partial rotary), each trained two steps with its
own BPE tokenizer and a non-default rotary base (so a reader that falls back to its own defaults is caught), the
exported directory is loaded with AutoTokenizer + AutoModelForCausalLM by the installed transformers and by
transformers 4.57 in a throwaway virtual environment (torch is shared through a .pth file, not reinstalled).
Each reports the largest logit difference to hlat's own forward pass (relative to the largest logit) and whether
greedy generate() continues a prompt with exactly hlat's tokens. Not part of the test suite: it installs
packages (from the machine's package index).

    python benchmarks/hf_export_compat.py [--version 4.57.6]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
import transformers

from hlat.checkpoint.state import load_weights
from hlat.cli import main as hlat
from hlat.config.job import load_config
from hlat.data.tokenizer import load_tokenizer
from hlat.models import build_model, materialize
from hlat.paths import latest_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from results_io import markdown_table, write_results  # noqa: E402

PROMPT = "def encode(obj):\n    return"
NEW_TOKENS = 8
# Runs in either transformers: the logits of the prompt and a greedy continuation, as JSON on stdout.
READER = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
path, prompt, new = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
ids = tok(prompt, return_tensors="pt")
with torch.no_grad():
    logits = model(ids.input_ids).logits[0]
    out = model.generate(**ids, max_new_tokens=new, do_sample=False)
print(json.dumps({"version": transformers.__version__, "ids": ids.input_ids[0].tolist(), "logits": logits.tolist(),
                  "generated": out[0].tolist(), "eos": tok.eos_token_id}))
"""


def export_run(family: str, work: Path) -> tuple[Path, torch.nn.Module, int]:
    corpus = str(Path(json.__file__).parent / "*.py")
    run, out = work / f"{family}-run", work / f"{family}-hf"
    hlat(
        [
            "train",
            "--model.preset",
            "tiny-neox" if family == "neox" else "tiny",
            "--model.dim",
            "64",
            "--model.n_layers",
            "2",
            "--model.n_heads",
            "4",
            *(["--model.n_kv_heads", "2"] if family == "llama" else []),
            "--model.ffn_dim",
            "128",
            "--model.vocab_size",
            "384",
            "--model.rope_theta",
            "20000",
            "--data.paths",
            corpus,
            "--data.workers",
            "0",
            "--train.steps",
            "2",
            "--train.global_batch",
            "2",
            "--train.micro_batch",
            "2",
            "--train.seq_len",
            "32",
            "--optim.warmup_steps",
            "1",
            "--train.run_dir",
            str(run),
        ]
    )
    hlat(["export-hf", str(run), "--out", str(out)])
    ckpt = latest_checkpoint(run)
    model = materialize(build_model(load_config(ckpt / "config.toml").model), "cpu").eval()
    load_weights(ckpt, [model])
    return out, model, load_tokenizer(run).eos_id


def hlat_greedy(model: torch.nn.Module, ids: list[int], eos: int) -> tuple[torch.Tensor, list[int]]:
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(tokens)[0]
        for _ in range(NEW_TOKENS):
            token = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, token], dim=1)
            if token.item() == eos:
                break
    return logits, tokens[0].tolist()


def throwaway_python(work: Path, version: str) -> Path:
    venv = work / f"transformers-{version}"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"transformers=={version}"], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # torch from this environment; the venv's own packages (transformers, tokenizers, hub) come first on sys.path
    Path(site, "shared-torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def read_with(python: str, path: Path) -> dict:
    result = subprocess.run(
        [python, "-c", READER, str(path), PROMPT, str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        env={"PYTHONNOUSERSITE": "1", "PATH": "/usr/bin:/bin"},
    )
    if result.returncode:
        raise SystemExit(f"{python} could not read {path}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default="4.57.6", help="the older transformers to check (default 4.57.6)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        readers = [sys.executable, str(throwaway_python(work, args.version))]
        for family in ("llama", "neox"):
            path, model, eos = export_run(family, work)
            for python in readers:
                got = read_with(python, path)
                ours, expected = hlat_greedy(model, got["ids"], eos)
                theirs = torch.tensor(got["logits"])
                rows.append(
                    {
                        "family": family,
                        "transformers": got["version"],
                        "max_rel_logit_error": float((ours - theirs).abs().max() / theirs.abs().max()),
                        "eos_read": got["eos"] == eos,
                        "generate_matches": got["generated"] == expected,
                        "new_tokens": len(expected) - len(got["ids"]),
                    }
                )
    header = ["family", "transformers", "max logit error (relative)", "eos read", "generate() = hlat greedy"]
    table = markdown_table(
        header,
        [
            [
                r["family"],
                r["transformers"],
                f"{r['max_rel_logit_error']:.1e}",
                "yes" if r["eos_read"] else "NO",
                "yes" if r["generate_matches"] else "NO",
            ]
            for r in rows
        ],
    )
    caption = (
        f"`hlat export-hf` directories read by transformers {transformers.__version__} (installed) and "
        f"{args.version} (throwaway venv): tiny models, rotary base 20000, fp32 on CPU "
        f"(benchmarks/hf_export_compat.py)."
    )
    write_results(
        "hf_export_compat",
        {"installed": transformers.__version__, "older": args.version, "torch": torch.__version__},
        rows,
        caption,
        table,
    )
    if not all(r["max_rel_logit_error"] < 1e-5 and r["eos_read"] and r["generate_matches"] for r in rows):
        raise SystemExit("some reader disagrees with hlat")


if __name__ == "__main__":
    main()
