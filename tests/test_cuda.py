"""CUDA only (skipped without a GPU): a few fp32 training steps on CUDA follow the CPU, every bf16 mode trains
there, and the stochastic rounding's bits compiled for CUDA are the CPU's. The full check (float64 reference,
compiled BF16AdamW against eager) is benchmarks/gpu_step.py."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def losses(device: str, mode: str = "fp32", steps: int = 4) -> list[float]:
    from hlat.models import build_model, materialize
    from hlat.models.config import model_config
    from hlat.optim import OptimConfig, build_optimizer
    from hlat.optim.precision import autocast, prepare_model

    cfg = model_config("tiny")
    model = materialize(prepare_model(build_model(cfg), mode), device)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3, warmup_steps=0), mode)
    tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0)).to(device)
    out = []
    for _ in range(steps):
        with autocast(mode, torch.device(device)):
            loss = model(tokens[:, :-1], targets=tokens[:, 1:])  # the chunked loss (model.loss_chunk)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def test_fp32_on_cuda_follows_the_cpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu, cuda = losses("cpu"), losses("cuda")
    assert max(abs(a - b) / b for a, b in zip(cuda, cpu)) < 1e-4  # fp32 roundoff over 4 steps of a tiny model


@pytest.mark.parametrize("mode", ["bf16_mixed", "bf16_sr", "bf16_kahan"])
def test_bf16_modes_train_on_cuda(mode):
    run = losses("cuda", mode, steps=8)
    assert all(x == x for x in run) and run[-1] < run[0]


def test_rounding_bits_compiled_for_cuda_are_the_cpus():
    """BF16AdamW's update is compiled on CUDA and runs eagerly on the CPU; its random bits, Triton's int32 hash
    with the key halves as device tensors, must be the very bits eager torch draws on the CPU (any size: dynamic
    shapes, odd lengths)."""
    from hlat.optim.bf16 import rounding_noises

    compiled = torch.compile(rounding_noises, dynamic=True, fullgraph=True)
    key_lo, key_hi = -123456789, 2**31 - 1
    keys = torch.tensor([key_lo, key_hi], dtype=torch.int32, device="cuda")
    for n in (1001, (1 << 20) + 3):
        on_cuda = compiled(n, keys.device, keys[0], keys[1])
        on_cpu = rounding_noises(n, "cpu", key_lo, key_hi)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(on_cuda, on_cpu, strict=True))


def packed_rows(seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """Two rows of packed documents (lengths not multiples of FlexAttention's 128-token blocks), on CUDA."""
    lengths = [[130, 200, 182], [40, 300, 90, 82]]
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    positions = torch.cat([torch.arange(n) for n in sum(lengths, [])]).view(2, seq)
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "doc_ids": doc_ids, "positions": positions}
    return {k: t.cuda() for k, t in batch.items()}


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_flex_attention_follows_the_dense_document_mask(recompute, monkeypatch):
    """On CUDA packed documents attend through compiled FlexAttention and its block mask; the loss and every
    gradient equal those of SDPA with the dense mask (the CPU's path, forced here). fp32 without TF32: the two
    kernels sum the same terms in another order, 2^-24 per operation over at most 512 keys (< 3e-5) and the two
    blocks' matmuls, so 1e-4 of each figure's largest value."""
    from hlat.models import build_model, layers
    from hlat.models.config import model_config
    from hlat.parallel.recompute import apply_recomputation

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = model_config(
        family="llama",
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=256,
        vocab_size=512,
        max_seq_len=512,
        doc_mask=True,
    )
    batch = packed_rows(512, cfg.vocab_size)
    assert isinstance(layers.document_mask(batch["doc_ids"]), layers.BlockMask)

    def loss_and_grads() -> dict[str, torch.Tensor]:
        model = build_model(cfg, "cuda")
        apply_recomputation(model, recompute)
        loss = model(batch["inputs"], positions=batch["positions"], doc_ids=batch["doc_ids"], targets=batch["targets"])
        loss.backward()
        return {"loss": loss.detach(), **{name: p.grad for name, p in model.named_parameters()}}

    flex = loss_and_grads()
    monkeypatch.setattr(layers, "attention_mask", layers.dense_mask)
    dense = loss_and_grads()
    for name, expected in dense.items():
        assert (flex[name] - expected).abs().max() <= 1e-4 * expected.abs().max(), name
