"""The chunked output layer and loss (hlat.models.loss.linear_cross_entropy) against a float64 reference: its value
and its gradients for the hidden states and the output weight, with ignored targets, chunk sizes that do and do
not divide the tokens, in float64, fp32, bf16 and bf16 autocast; through the model (model.loss_chunk, and the plain
path); and vocabulary-parallel under tensor parallelism 2 with and without sequence parallelism."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from hlat.fields import ConfigError
from hlat.models import build_model, materialize
from hlat.models.config import model_config
from hlat.models.loss import IGNORE_INDEX, cross_entropy, linear_cross_entropy

TOKENS, DIM, VOCAB = 63, 48, 300
CHUNKS = [1, 8, 63, 1000]  # 8 does not divide 63 tokens; 1000 is one chunk
U32 = 2.0**-24  # unit roundoff of fp32
UNIT = {torch.float64: 2.0**-53, torch.float32: U32, torch.bfloat16: 2.0**-8}


def problem(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states [3, 21, DIM], an output weight [VOCAB, DIM] (logits of about unit size) and targets with 10
    ignored, the floats exactly representable in `dtype` (so the float64 reference sees the same inputs)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, TOKENS // 3, DIM, generator=generator, dtype=torch.float64).to(dtype)
    weight = (torch.randn(VOCAB, DIM, generator=generator, dtype=torch.float64) / math.sqrt(DIM)).to(dtype)
    targets = torch.randint(0, VOCAB, (3, TOKENS // 3), generator=generator)
    targets.view(-1)[torch.randperm(TOKENS, generator=generator)[:10]] = IGNORE_INDEX
    return hidden, weight, targets


def loss_and_grads(loss_fn, hidden, weight, targets, reduction):
    """The loss and its gradients for hidden and weight, backward from half the loss (so the incoming gradient
    is not 1; a power of two, exact in every dtype)."""
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = loss_fn(hidden, weight, targets, reduction)
    (loss / 2).backward()
    return loss.detach().double(), hidden.grad.double(), weight.grad.double()


def reference(hidden, weight, targets, reduction):
    return loss_and_grads(
        lambda h, w, t, r: F.cross_entropy((h @ w.T).flatten(0, 1), t.flatten(), reduction=r),
        hidden.double(),
        weight.double(),
        targets,
        reduction,
    )


def chunked(chunk: int, autocast: bool = False):
    def loss_fn(hidden, weight, targets, reduction):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return linear_cross_entropy(hidden, weight, targets, reduction, chunk)

    return loss_fn


def plain(autocast: bool = False):
    def loss_fn(hidden, weight, targets, reduction):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = F.linear(hidden, weight)
        return cross_entropy(logits, targets, reduction)

    return loss_fn


def assert_within(got, expected, bounds):
    for name, g, e, bound in zip(("loss", "hidden grad", "weight grad"), got, expected, bounds):
        excess = ((g - e).abs() - bound).max().item()
        assert excess <= 0, (name, excess, (g - e).abs().max().item())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_float64_chunks_equal_the_reference(chunk, reduction):
    """In float64 the chunked loss differs from F.cross_entropy only by the order of its sums: 2^-53 per operation
    over sums of at most a few hundred terms, far below 1e-12 of each figure's scale. Any slip in the chunking,
    the ignored targets or the scaling shows at once."""
    hidden, weight, targets = problem(torch.float64)
    got = loss_and_grads(chunked(chunk), hidden, weight, targets, reduction)
    expected = reference(hidden, weight, targets, reduction)
    assert_within(got, expected, [1e-12 * e.abs().max() for e in expected])


def error_bounds(hidden, weight, targets, reduction, unit):
    """First-order worst-case bounds on |computed - exact| for the loss and the gradients for hidden and weight,
    elementwise, when the logits and the matmuls are computed in a dtype of unit roundoff `unit` (accumulating in
    fp32) and the softmax and loss in fp32:
    - each logit z_ij is off by at most e_ij = unit |z_ij| + DIM u32 (|h| |w|^T)_ij; let d_i = max_j e_ij;
    - a token's loss lse_i - z_i,target by 2 d_i, plus fp32 roundoff of the log-sum-exp over VOCAB terms;
    - softmax p_ij by p_ij (exp(2 d_i) - 1 + VOCAB u32); the gradient of the logits s (p - onehot) (s: 1/count or
      1) is then rounded to the dtype (unit |g|);
    - gradients g^T h and g w add a matmul output's rounding and the rounding to the parameter's dtype (2 unit)
      and fp32 accumulation over the tokens or vocabulary."""
    h, w = hidden.double().flatten(0, 1), weight.double()
    t = targets.flatten()
    counted = t != IGNORE_INDEX
    scale = 1.0 / counted.sum() if reduction == "mean" else 1.0
    z = h @ w.T
    d = (unit * z.abs() + DIM * U32 * (h.abs() @ w.abs().T)).amax(1)
    p = z.softmax(-1)
    g = scale * (p - F.one_hot(t.clamp(min=0), VOCAB)) * counted[:, None]
    token_losses = (z.logsumexp(-1) - z.gather(1, t.clamp(min=0)[:, None])[:, 0]) * counted
    lse_roundoff = (VOCAB + 2) * U32 * (z.logsumexp(-1).abs() + z.abs().amax(1))
    loss_bound = scale * ((2 * d + lse_roundoff) * counted).sum() + TOKENS * U32 * scale * token_losses.abs().sum()
    softmax_error = scale * p * ((2 * d).exp() - 1 + VOCAB * U32)[:, None] * counted[:, None]
    per_logit = (softmax_error + unit * g.abs()) / 2  # backward from half the loss
    hidden_bound = per_logit @ w.abs() + (2 * unit + VOCAB * U32) * (g.abs() / 2) @ w.abs()
    weight_bound = per_logit.T @ h.abs() + (2 * unit + TOKENS * U32) * (g.abs() / 2).T @ h.abs()
    return loss_bound, hidden_bound.view(hidden.shape), weight_bound


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "dtype, autocast",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "bf16_autocast"],
)
def test_chunked_and_plain_losses_within_the_arithmetic_of_their_dtype(dtype, autocast, reduction):
    """Every chunk size, and the plain path over the whole logits, stay within `error_bounds` of the float64
    reference; with autocast (bf16_mixed) the weight and hidden states are fp32 and their gradients come back in
    fp32."""
    hidden, weight, targets = problem(torch.bfloat16 if autocast else dtype)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    expected = reference(hidden, weight, targets, reduction)
    bounds = error_bounds(hidden, weight, targets, reduction, UNIT[torch.bfloat16 if autocast else dtype])
    for loss_fn in [plain(autocast)] + [chunked(c, autocast) for c in CHUNKS]:
        got = loss_and_grads(loss_fn, hidden, weight, targets, reduction)
        assert_within(got, expected, bounds)


def test_without_gradients_the_loss_is_the_same():
    hidden, weight, targets = problem(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, "sum", 8)
    assert loss.item() == loss_and_grads(chunked(8), hidden, weight, targets, "sum")[0].item()


def tiny_model(loss_chunk: int, tie_embeddings: bool = False):
    """A float64 model on the meta device (to be parallelised, then materialised)."""
    cfg = model_config(
        "tiny",
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        vocab_size=512,
        tie_embeddings=tie_embeddings,
        loss_chunk=loss_chunk,
    )
    return build_model(cfg).to(torch.float64)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(1))
    targets = rows[:, 1:].clone()
    targets[0, :3] = IGNORE_INDEX
    targets[1, 9] = IGNORE_INDEX
    return rows[:, :-1], targets


def model_loss_and_grads(model, tokens, targets, with_targets: bool = True) -> dict[str, torch.Tensor]:
    """The model's loss (given the targets, or F.cross_entropy of its float64 logits) and every parameter's
    gradient, full tensors under tensor parallelism."""
    if with_targets:
        loss = model(tokens, targets=targets)
    else:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    out = {"loss": loss.detach()}
    for name, param in model.named_parameters():
        grad = param.grad
        out[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return out


def largest_error(got: dict, expected: dict) -> float:
    return max(((got[k] - expected[k]).abs().max() / expected[k].abs().max()).item() for k in expected)


@pytest.mark.parametrize("tied", [False, True])
def test_the_models_loss_paths_equal_its_logits_loss(tied):
    """model(tokens, targets=...) chunked (5 tokens, not dividing 32) and plain (loss_chunk = 0) against
    F.cross_entropy of the model's own logits, all in float64: the figures differ by float64 roundoff (2^-53 per
    operation) through two blocks, far below 1e-9 of each."""
    tokens, targets = batch()
    expected = model_loss_and_grads(materialize(tiny_model(0, tied), "cpu"), tokens, targets, with_targets=False)
    for chunk in (5, 0):
        got = model_loss_and_grads(materialize(tiny_model(chunk, tied), "cpu"), tokens, targets)
        assert largest_error(got, expected) < 1e-9, chunk


def test_loss_chunk_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"model.loss_chunk: must be >= 0 .*got -1"):
        model_config("tiny", loss_chunk=-1)


def vocabulary_parallel_worker(path: str) -> None:  # one rank of a job of tests/warm_torchrun.py
    """Tensor parallelism 2, with and without sequence parallelism, the chunked and the plain loss: each one's
    largest relative error against the single-process float64 reference."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from hlat.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tokens, targets = batch()
    expected = model_loss_and_grads(materialize(tiny_model(0), "cpu"), tokens, targets, with_targets=False)
    errors = {}
    for sequence_parallel in (False, True):
        for chunk in (5, 0):
            model = tiny_model(chunk)
            apply_tensor_parallel(model, mesh, sequence_parallel)
            materialize(model, "cpu")
            with loss_parallel():  # what the plain path's sharded logits need; the chunked one needs nothing
                got = model_loss_and_grads(model, tokens, targets)
            errors[f"sp={sequence_parallel} chunk={chunk}"] = largest_error(got, expected)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(errors, f)


def test_vocabulary_parallel_loss_equals_the_single_process(tmp_path, warm_torchrun):
    """The logits stay sharded over the vocabulary (the chunked path exchanges only per-token log-sum-exps and
    target logits); under sequence parallelism the gathered hidden states line up with the targets. float64, so
    only the order of sums differs: below 1e-9."""
    done = warm_torchrun.call(2, "test_loss:vocabulary_parallel_worker", str(tmp_path / "errors.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert len(errors) == 4 and all(error < 1e-9 for error in errors.values()), errors
