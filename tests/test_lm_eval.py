"""lm-evaluation-harness on an exported hlat model, with a local task (nothing is downloaded). Optional: skipped
when lm_eval is not installed (it is not part of hlat's install; see docs/monitoring.md)."""

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's HF model class needs the [hf] extra

from hlat.data.tokenizer import EOS, train_bpe  # noqa: E402
from hlat.models import build_model, materialize  # noqa: E402
from hlat.models.config import model_config  # noqa: E402
from hlat.models.hf import write_hf_dir  # noqa: E402

QUESTIONS = [  # every choice starts a new word, so no BPE merge crosses the context's end
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "answer": 0},
    {"question": "x = 1\ny =", "choices": [" x + 1", " 'a'", " ]"], "answer": 0},
    {"question": "for i in", "choices": [" range(10):", " 10:", " ):"], "answer": 0},
]
TASK = """task: hlat_local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def loglikelihood(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | context) under the hlat model, tokenized as lm-eval does: the whole string encoded
    at once, the continuation being what follows the context's own tokens."""
    (whole,) = tok.encode_batch([context + continuation])
    (ctx,) = tok.encode_batch([context])
    ids = torch.tensor(whole)
    with torch.no_grad():
        logprobs = model(ids[None, :-1])[0].double().log_softmax(-1)
    return sum(logprobs[i - 1, ids[i]].item() for i in range(len(ctx), len(whole)))


def test_lm_eval_hf_model_on_an_exported_model(tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    texts = [q["question"] + c for q in QUESTIONS for c in q["choices"]] * 20
    tok = train_bpe(texts, 300)
    tok.save(tmp_path)
    cfg = model_config(
        "tiny", dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=320, max_seq_len=128, init_std=0.2
    )
    model = materialize(build_model(cfg), "cpu", seed=1).eval()
    write_hf_dir(cfg, model.state_dict(), tmp_path / "hf")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "task.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), eos_token=EOS)
    lm = HFLM(pretrained=str(tmp_path / "hf"), tokenizer=hf_tok, batch_size=1, device="cpu", dtype="float32")
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["hlat_local_choice"],
        log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
    )
    samples = out["samples"]["hlat_local_choice"]
    assert len(samples) == len(QUESTIONS)
    correct = 0
    for sample in samples:
        q = sample["doc"]
        theirs = [resp[0][0] for resp in sample["resps"]]
        ours = [loglikelihood(model, tok, q["question"], c) for c in q["choices"]]
        assert theirs == pytest.approx(ours, rel=1e-4, abs=1e-4)
        correct += max(range(len(ours)), key=ours.__getitem__) == q["answer"]
    assert out["results"]["hlat_local_choice"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
