"""Generation speed with the KV cache against recomputing the whole prefix for every new token, on this machine
(hlat's own models, random weights: speed does not depend on them). Greedy decoding of a fixed number of tokens
(no EOS stop); the two ways are interleaved so machine noise hits both alike, and the table gives the best of
`--repeats` runs each and their ratio (measured within one run, so the ratio is the figure to trust).

    .venv/bin/python benchmarks/generation.py [--presets tiny,tiny-neox,small] [--prompt 32] [--new 128]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from results_io import markdown_table, write_results

from hlat.models import build_model, count_params, materialize
from hlat.models.config import model_config
from hlat.models.generate import generate


def tokens_per_s(model, prompt: list[int], new: int, use_cache: bool) -> float:
    start = time.perf_counter()
    out = generate(model, [prompt], new, use_cache=use_cache)[0]
    assert len(out) == new
    return new / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,tiny-neox,small")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="tokens generated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows = []
    for preset in args.presets.split(","):
        cfg = model_config(preset)
        model = materialize(build_model(cfg), "cpu").eval()
        prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0))
        prompt = prompt.tolist()
        assert generate(model, [prompt], 16)[0] == generate(model, [prompt], 16, use_cache=False)[0]
        tokens_per_s(model, prompt, 4, True)  # warm-up
        cached, recomputed = [], []
        for _ in range(args.repeats):
            cached.append(tokens_per_s(model, prompt, args.new, True))
            recomputed.append(tokens_per_s(model, prompt, args.new, False))
        row = {
            "model": preset,
            "params": count_params(model),
            "kv_cache_tok_s": round(max(cached), 1),
            "recompute_tok_s": round(max(recomputed), 1),
            "speedup": round(max(cached) / max(recomputed), 2),
        }
        rows.append(row)
        print(row, flush=True)

    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "repeats": args.repeats,
    }
    caption = (
        f"Greedy generation of {args.new} tokens after a {args.prompt}-token prompt, batch 1, fp32, CPU, "
        f"{meta['threads']} threads, torch {torch.__version__}; best of {args.repeats} runs each, "
        "interleaved, on a machine shared with other jobs (compare the ratio, not the absolute speeds)."
    )
    table = markdown_table(
        ["model", "params", "KV cache tok/s", "recompute prefix tok/s", "KV cache / recompute"],
        [[r["model"], f"{r['params']:,}", r["kv_cache_tok_s"], r["recompute_tok_s"], r["speedup"]] for r in rows],
    )
    write_results("generation", meta, rows, caption, table)


if __name__ == "__main__":
    main()
