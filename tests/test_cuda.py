"""CUDA only (skipped without a GPU): a few fp32 training steps on CUDA follow the CPU, and every bf16 mode
trains there. The full check (float64 reference, compiled BF16AdamW against eager) is benchmarks/gpu_step.py."""

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

