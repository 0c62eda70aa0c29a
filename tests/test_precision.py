"""Precision modes: stochastic rounding, the bf16 AdamW (against torch's AdamW), data-parallel replicas on a 2-process
gloo mesh, exact checkpoint round trips, and the bytes per parameter that `hlat describe` and the planner report."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hlat.fields import ConfigError
from hlat.models import build_model, materialize
from hlat.models.config import model_config
from hlat.optim import OptimConfig, bf16, build_optimizer
from hlat.optim.bf16 import BF16AdamW, rounding_noise, rounding_noises, rounding_seed, stochastic_round
from hlat.optim.modes import MODES
from hlat.optim.precision import autocast, prepare_model
from hlat.parallel.grads import clip_coefficient, clip_in_place, global_grad_norm
from hlat.train.step import clipped_update

BF16 = torch.bfloat16
# Across magnitudes and signs, between bf16 neighbours at different fractions, fp32 subnormals (bf16 has them too).
VALUES = torch.tensor(
    [1.0 + 2**-9, 1.0 + 3 * 2**-10, -0.1, 3.3e-5, -123.456, 6.02e23, -1e-30, 2**-130, -3e-39, 1.0, 0.0]
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each fp32 value (both equal x where x is a bf16 value)."""
    nearest = x.to(BF16)
    inf = torch.full_like(nearest, math.inf)
    below = torch.where(nearest.float() > x, torch.nextafter(nearest, -inf), nearest)
    above = torch.where(nearest.float() < x, torch.nextafter(nearest, inf), nearest)
    return below, above


def assert_neighbour(rounded: torch.Tensor, exact: torch.Tensor) -> None:
    below, above = neighbours(exact)
    assert rounded.dtype == BF16
    assert bool(((rounded == below) | (rounded == above)).all())


def test_stochastic_rounding_is_unbiased():
    n = 40_000
    rounded = stochastic_round(VALUES.expand(n, -1), 0).double()
    below, above = (t.double() for t in neighbours(VALUES))
    # Each rounding is a Bernoulli choice between the neighbours: the mean's standard error is gap * sqrt(p(1-p)/n).
    p = ((VALUES.double() - below) / (above - below)).nan_to_num(0.0)
    stderr = (above - below) * (p * (1 - p) / n).sqrt()
    error = (rounded.mean(0) - VALUES.double()).abs()
    assert bool((error <= 5 * stderr + 1e-300).all()), (error / stderr).tolist()
    assert bool((rounded[:, -2:] == VALUES[-2:].double()).all())  # bf16 values are never moved
    # The test can fail: round-to-nearest is off by far more than the tolerance.
    assert bool(((VALUES.to(BF16).double() - VALUES.double()).abs() > 5 * stderr + 1e-300).any())


def test_stochastic_rounding_only_yields_neighbours():
    x = torch.randn(100_000, generator=gen(1)) * torch.logspace(-40, 38, 100_000)
    assert_neighbour(stochastic_round(x, 2), x)
    special = torch.tensor([math.inf, -math.inf, math.nan, -0.0])
    out = stochastic_round(special.expand(1000, -1), 3)
    assert bool((out[:, 0] == math.inf).all() and (out[:, 1] == -math.inf).all() and out[:, 2].isnan().all())
    assert bool((out[:, 3] == 0).all() and out[:, 3].float().signbit().all())


def test_stochastic_rounding_is_deterministic_under_a_seed():
    x = torch.randn(10_000, generator=gen(4))
    assert torch.equal(stochastic_round(x, 5), stochastic_round(x, 5))
    assert not torch.equal(stochastic_round(x, 5), stochastic_round(x, 6))
    assert not torch.equal(stochastic_round(x, 5), stochastic_round(x, 5, stream=1))
    assert not torch.equal(stochastic_round(x, 5), stochastic_round(x, 5 + 2**40))  # the key's high half counts


# --- the rounding's statistics ------------------------------------------------------------------------------
# Each check is a deterministic function of fixed keys (pass or fail, never flaky); its bounds are where an ideal
# random source would land with probability about 1e-9 (6 standard deviations).

SIGMAS = 6.0


def chi2_bound(df: int, z: float = SIGMAS) -> float:
    """The chi-square quantile z standard deviations out (Wilson-Hilferty; z < 0 for the lower tail)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def noise(key: int, n: int, stream: int = 0) -> torch.Tensor:
    return rounding_noise(torch.empty(n), key & 0xFFFFFFFF, key >> 32, stream)


def assert_independent_uniform(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """`a` and `b` (16-bit draws) are each uniform, uncorrelated, and jointly uniform over 16 x 16 cells of their top
    4 bits (which a dependence of any shape between the two would unbalance)."""
    n = len(a)
    for u in (a, b):
        for bins in (u >> 8, u & 255):  # the high and the low byte
            chi2 = ((torch.bincount(bins, minlength=256) - n / 256) ** 2 / (n / 256)).sum().item()
            assert chi2 < chi2_bound(255), (what, chi2)
    r = torch.corrcoef(torch.stack([a, b]).double())[0, 1].item()
    assert abs(r) * math.sqrt(n) < SIGMAS, (what, r)
    cells = torch.bincount((a >> 12) * 16 + (b >> 12), minlength=256)
    chi2 = ((cells - n / 256) ** 2 / (n / 256)).sum().item()
    assert chi2_bound(255, -SIGMAS) < chi2 < chi2_bound(255), (what, chi2)


def test_rounding_bits_are_independent_across_elements_streams_steps_parameters_and_ranks():
    n = 1 << 18
    key = rounding_seed(0, 1, 0)
    u = noise(key, n + 1024)
    for lag in (1, 2, 3, 1024):  # neighbouring elements of a tensor
        assert_independent_uniform(u[:n], u[lag : n + lag], f"elements {lag} apart")
    others = {
        "the next stream (the first moment)": noise(key, n, 1),
        "stream 2 (the second moment)": noise(key, n, 2),
        "the next step": noise(rounding_seed(0, 2, 0), n),
        "the next parameter": noise(rounding_seed(0, 1, 1), n),
        "another seed": noise(rounding_seed(1, 1, 0), n),
        "another shard (rank)": noise(rounding_seed(0, 1, 0, (1,)), n),
        "a key one bit away, low half": noise(key ^ 1, n),
        "a key one bit away, high half": noise(key ^ 2**32, n),
    }
    for what, v in others.items():
        assert_independent_uniform(u[:n], v, what)
    assert torch.equal(noise(rounding_seed(0, 1, 0, (1,)), n), noise(rounding_seed(0, 1, 0, (1,)), n))  # replicas


def test_the_three_streams_are_independent_of_each_other_and_along_a_tensor():
    """Streams 0 and 1 (the weight's and the first moment's) are the two halves of one 32-bit hash per element,
    stream 2 (the second moment's) half of a second hash: every pair of streams, at one element and at neighbouring
    ones, and stream 2 along the tensor, are independent uniform draws (stream 0 along the tensor is checked
    above)."""
    n = 1 << 18
    key = rounding_seed(0, 1, 0)
    streams = [noise(key, n + 3, stream) for stream in range(3)]
    for lag in (1, 2, 3):
        assert_independent_uniform(streams[2][:n], streams[2][lag : n + lag], f"stream 2, elements {lag} apart")
    for a, b in ((0, 1), (0, 2), (1, 2)):
        for lag in (0, 1):
            assert_independent_uniform(streams[a][:n], streams[b][lag : n + lag], f"streams {a}, {b} lag {lag}")
            assert_independent_uniform(streams[b][:n], streams[a][lag : n + lag], f"streams {b}, {a} lag {lag}")


def lowbias32(x: int) -> int:
    """Wellons' lowbias32 on a Python int: the unsigned 32-bit reference."""
    x ^= x >> 16
    x = x * 0x7FEB352D & 0xFFFFFFFF
    x ^= x >> 15
    x = x * 0x846CA68B & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_rounding_bits_are_the_unsigned_hash():
    """The int32 arithmetic (wrapping multiplies, arithmetic shifts masked) is the unsigned hash: element i's state
    is lowbias32(i ^ key_lo); streams 0 and 1 are the high and low halves of lowbias32(state ^ key_hi), stream 2 the
    high half of lowbias32(state ^ key_hi ^ 0x9E3779B9). Key halves with their top bit set, indices past 2^16."""
    key_lo, key_hi, n = 0xDEADBEEF, 0xF00DFACE, 70_001
    streams = [rounding_noise(torch.empty(n), key_lo, key_hi, stream) for stream in range(3)]
    for i in (0, 1, 2**15, 2**16 + 1, n - 1):
        state = lowbias32(i ^ key_lo)
        first, second = lowbias32(state ^ key_hi), lowbias32(state ^ key_hi ^ 0x9E3779B9)
        assert [int(s[i]) for s in streams] == [first >> 16, first & 0xFFFF, second >> 16], i


def test_rounding_refuses_tensors_beyond_int32_indices():
    """Elements are numbered in int32: a tensor of 2^31 elements or more would repeat bits, so it is refused (at
    the optimizer's construction, before any step)."""
    with pytest.raises(ValueError, match="at most"):
        rounding_noises(2**31, "cpu", 0, 0)
    with pytest.raises(ValueError, match="at most"):
        BF16AdamW([torch.nn.Parameter(torch.empty(2**31, dtype=BF16, device="meta"))])


def fractional_values(m: int, seed: int) -> torch.Tensor:
    """`m` fp32 values of random sign and exponent (subnormals included, below bf16's overflow), each between two bf16
    neighbours at a random fraction in [1/64, 63/64]: at least 64 of 4096 roundings go each way, so the mean of the
    roundings is close to normally distributed."""
    g = gen(seed)
    high = torch.randint(0, 2**16, (m,), generator=g)
    high = high.where((high >> 7) & 0xFF < 0xFE, high & ~(1 << 14))  # no exponent 0xFE or 0xFF
    high[: m // 8] &= 0x807F  # exponent 0: subnormals
    low = torch.randint(1024, 2**16 - 1024 + 1, (m,), generator=g)
    return ((high << 16) | low).to(torch.int32).view(torch.float32)


def rounded_copies(x: torch.Tensor, n: int, copies: str) -> torch.Tensor:
    """`n` stochastic roundings of each of `x`, as [n, len(x)]: as elements of one tensor under one key, or each
    element in its place under the keys of `n` steps, `n` seeds or `n` data-parallel shards (ranks)."""
    if copies == "elements":
        return stochastic_round(x.expand(n, -1), rounding_seed(0, 1, 0))
    keys = {
        "steps": lambda i: rounding_seed(0, i + 1, 0),
        "seeds": lambda i: rounding_seed(i, 1, 0),
        "ranks": lambda i: rounding_seed(0, 1, 0, (i,)),
    }[copies]
    return torch.stack([stochastic_round(x, keys(i)) for i in range(n)])


@pytest.mark.parametrize("copies", ["elements", "steps", "seeds", "ranks"])
def test_stochastic_rounding_is_unbiased_and_its_copies_independent(copies):
    """For 4096 values across magnitudes (subnormals too) and signs, the mean of 4096 roundings lies within what a
    mean of independent Bernoulli choices allows: each value's z-score, the mean z (a bias in one direction over
    many values) and the mean z^2 (copies that depend on each other make the mean vary more, or less, than
    independent ones). Values already in bf16 are never moved."""
    m, n = 4096, 4096
    x = fractional_values(m, seed=len(copies))
    below, above = (t.double() for t in neighbours(x))
    p = (x.double() - below) / (above - below)
    rounded = rounded_copies(x, n, copies)
    assert_neighbour(rounded, x.expand(n, -1))
    z = (rounded.double().mean(0) - x.double()) / ((above - below) * (p * (1 - p) / n).sqrt())
    assert z.abs().max().item() < SIGMAS + 1, z.abs().max().item()  # the largest of 4096 normals
    assert abs(z.mean().item()) * math.sqrt(m) < SIGMAS, z.mean().item()
    assert chi2_bound(m, -SIGMAS) < (z**2).sum().item() < chi2_bound(m), (z**2).mean().item()
    exact = x.to(BF16).float()  # in bf16 already: subnormals, both signs, every magnitude
    assert torch.equal(rounded_copies(exact, 8, copies).float(), exact.expand(8, -1))


@pytest.mark.parametrize("grad_scale", [None, 0.3])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_update_matches_torch_adamw(rounding, grad_scale):
    """Each step from the same bf16 state equals torch.optim.AdamW's fp32 step, rounded: exactly to nearest, or to
    a bf16 neighbour stochastically (weights and both moments, at steps 1-3 so bias correction is exercised). With
    a `grad_scale` (clipping's coefficient, a 0-d tensor as the trainer passes it), torch's AdamW is given the
    gradient times it in fp32."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 33).to(BF16))
    hparams = dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    ours = BF16AdamW([w], **hparams, rounding=rounding, seed=1)
    ref = torch.nn.Parameter(w.detach().float())
    theirs = torch.optim.AdamW([ref], **hparams, foreach=False)
    for _ in range(3):
        grad = torch.randn(w.shape) * 1e-2
        scale = None if grad_scale is None else torch.tensor(grad_scale)
        w.grad, ref.grad = grad.to(BF16), grad.to(BF16).float() * (1.0 if scale is None else scale)
        with torch.no_grad():
            ref.copy_(w)
        if ours.state:  # the reference starts from our rounded moments
            theirs.state[ref].update({k: ours.state[w][k].float().clone() for k in ("exp_avg", "exp_avg_sq")})
        ours.step(grad_scale=scale)
        theirs.step()
        for mine, exact in (
            (w, ref),
            (ours.state[w]["exp_avg"], theirs.state[ref]["exp_avg"]),
            (ours.state[w]["exp_avg_sq"], theirs.state[ref]["exp_avg_sq"]),
        ):
            if rounding == "nearest":
                assert torch.equal(mine.detach(), exact.detach().to(BF16))
            else:
                assert_neighbour(mine.detach(), exact.detach())
    assert int(ours.state[w]["step"]) == 3


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between a and b, elementwise, counting through zero."""

    def ordinal(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordinal(a) - ordinal(b)).abs()


def test_clipping_folded_into_the_update_matches_clipping_first():
    """The trainer's `clipped_update` hands BF16AdamW the clip coefficient c, which scales each gradient g in fp32
    inside the update; clipping first (as for torch's AdamW) rounds g * c to bf16, a relative difference of at most
    2^-8 (bf16's unit roundoff). After one step from zero moments, the stored (1 - beta1) * g * c and
    (1 - beta2) * (g * c)^2 then differ before rounding by at most 2^-8 and 2^-7 of their value (plus fp32's
    2^-24s), at most 1 + and 2 + a hair bf16 spacings (a spacing is at least 2^-8 of the value); rounding both with
    the same random bits adds at most one more: m within 2 bf16 values, v within 3. The weights move by
    lr * m / (sqrt(v) + eps), nearly lr * sign(g) in both, far less than a spacing apart: within 1."""
    g = gen(0)
    shapes = ((64, 48), (333,))
    start = [torch.randn(shape, generator=g).sign() * (0.5 + torch.rand(shape, generator=g)) for shape in shapes]
    grads = [torch.randn(shape, generator=g).to(BF16) for shape in shapes]

    def one_step(folded: bool) -> tuple[list, BF16AdamW]:
        params = [torch.nn.Parameter(w.to(BF16)) for w in start]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        opt = BF16AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, seed=1)
        norm = global_grad_norm(params)
        max_norm = 0.3 * norm.item()
        assert clip_coefficient(norm, max_norm).item() < 0.31  # clipping scales: the test can fail
        if folded:
            clipped_update([opt], norm, max_norm)
        else:
            clip_in_place(params, max_norm, norm)
            opt.step()
        return params, opt

    (folded, opt_folded), (first, opt_first) = one_step(True), one_step(False)
    for a, b in zip(folded, first):
        m_a, v_a, m_b, v_b = (
            opt.state[p][k] for opt, p in ((opt_folded, a), (opt_first, b)) for k in ("exp_avg", "exp_avg_sq")
        )
        assert bf16_steps(m_a, m_b).max() <= 2 and bf16_steps(v_a, v_b).max() <= 3
        assert bf16_steps(a.detach(), b.detach()).max() <= 1
        assert not torch.equal(m_a, m_b)  # the runs did differ: bf16's rounding of g * c was left out of one


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # compile's imports
def test_compiled_update_equals_eager(monkeypatch):
    """BF16AdamW's update as it runs on CUDA, compiled (torch.compile with dynamic shapes, the int32 key halves,
    scalars and clip coefficient as tensors), here through the CPU's compiler: the same random bits and fp32
    arithmetic as eager, so the same weights and moments to the bit, over two steps of two parameters of odd sizes.
    It fails where the compiled path departs from eager: generated code that hashes or rounds otherwise, or keys,
    scalars or the clip coefficient handed to the kernel wrongly."""

    def two_steps(compiled: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(bf16, "COMPILED_UPDATE_DEVICES", ("cpu",) if compiled else ())
        g = gen(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=g).to(BF16)) for shape in ((37, 29), (1001,))]
        opt = BF16AdamW(params, lr=1e-2, weight_decay=0.1, seed=3)
        for _ in range(2):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(BF16)
            opt.step(grad_scale=torch.tensor(0.7))
        return [t for p in params for t in (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]

    eager, compiled = two_steps(False), two_steps(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def toy_descent(rounding: str | None, steps: int = 150) -> float:
    """AdamW pulling 4096 weights from 1.0 towards 0.8 with lr 1e-3: every update is below half a bf16 spacing at 1.0
    (2^-9), so round-to-nearest never moves. Returns the mean weight."""
    w = torch.nn.Parameter(torch.ones(4096, dtype=torch.float32 if rounding is None else BF16))
    hparams = dict(lr=1e-3, weight_decay=0.0)
    opt = torch.optim.AdamW([w], **hparams) if rounding is None else BF16AdamW([w], **hparams, rounding=rounding)
    for _ in range(steps):
        w.grad = (w.detach().float() - 0.8).to(w.dtype)
        opt.step()
    return w.detach().double().mean().item()


def test_stochastic_rounding_and_kahan_follow_fp32_where_nearest_stalls():
    fp32 = toy_descent(None)
    assert fp32 < 0.9  # moved ~0.15
    assert abs(toy_descent("stochastic") - fp32) < 0.003
    assert abs(toy_descent("kahan") - fp32) < 0.003
    assert toy_descent("nearest") == 1.0


TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)


def tiny_model(mode: str, tie: bool = False) -> torch.nn.Module:
    return prepare_model(materialize(build_model(model_config("tiny", **TINY, tie_embeddings=tie)), "cpu"), mode)


def train_steps(model, opt, steps: int, first: int) -> None:
    for step in range(first, first + steps):
        tokens = torch.randint(0, 256, (2, 17), generator=gen(step))
        loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def dcp_save(path, model, opt, options: StateDictOptions) -> None:
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def dcp_load(path, model, opt, options: StateDictOptions) -> None:
    model_sd, optim_sd = get_state_dict(model, opt, options=options)  # a fresh optimizer's state gets built here
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("mode", ["bf16_sr", "bf16_kahan"])
@pytest.mark.parametrize("flatten", [False, True])
def test_checkpoint_round_trip_is_bit_exact(tmp_path, mode, flatten):
    """Through DCP and get_state_dict/set_state_dict (plain or flattened, as a resharding trainer saves): a resumed
    run continues exactly, with the rounding seed restored from the checkpoint rather than the new optimizer's."""
    cfg, options = OptimConfig(lr=1e-2), StateDictOptions(flatten_optimizer_state_dict=flatten)
    model = tiny_model(mode)
    opt = build_optimizer(model, cfg, mode, seed=7)
    train_steps(model, opt, 3, first=0)
    dcp_save(tmp_path, model, opt, options)
    train_steps(model, opt, 3, first=3)

    resumed = tiny_model(mode)
    resumed_opt = build_optimizer(resumed, cfg, mode, seed=99)
    dcp_load(tmp_path, resumed, resumed_opt, options)
    train_steps(resumed, resumed_opt, 3, first=3)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert a.dtype == BF16 and torch.equal(a, b), name
    for a, b in zip(opt.state.values(), resumed_opt.state.values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed_opt.param_groups[0]["seed"] == 7


def test_prepare_model_build_optimizer_and_autocast():
    model = tiny_model("bf16_sr", tie=True)
    assert {p.dtype for p in model.parameters()} == {BF16}
    assert model.output.weight is model.tok_embeddings.weight  # still tied
    assert isinstance(build_optimizer(model, OptimConfig(), "bf16_sr"), BF16AdamW)
    assert build_optimizer(model, OptimConfig(), "bf16_kahan").rounding == "kahan"

    fp32 = tiny_model("bf16_mixed")
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    opt = build_optimizer(fp32, OptimConfig(decay_norms_and_biases=False), "bf16_mixed")
    assert type(opt) is torch.optim.AdamW and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    with pytest.raises(ValueError, match="bf16 parameters"):
        BF16AdamW(fp32.parameters())
    with pytest.raises(ConfigError, match="precision.mode: 'fp8'"):
        build_optimizer(fp32, OptimConfig(), "fp8")

    tokens = torch.zeros(1, 4, dtype=torch.long)
    with autocast("bf16_mixed", "cpu"):
        assert fp32(tokens).dtype == BF16
    with autocast("fp32", torch.device("cpu")):
        assert fp32(tokens).dtype == torch.float32


@pytest.mark.parametrize("mode", sorted(MODES))
def test_bytes_per_parameter_match_what_is_stored(mode):
    """modes.py's table is what the planner and `hlat describe` use: check it against real tensors."""
    model = tiny_model(mode)
    opt = build_optimizer(model, OptimConfig(), mode)
    train_steps(model, opt, 1, first=0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # what backward leaves between steps
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts) / numel  # noqa: E731
    states = [t for p in params for t in opt.state[p].values() if t.ndim > 0]  # not the scalar step counters
    table = MODES[mode]
    assert (nbytes(params), nbytes(p.grad for p in params), nbytes(states)) == (
        table.weight_bytes,
        table.grad_bytes,
        table.optimizer_bytes,
    )


def data_parallel_worker(out: str) -> None:  # one rank of a job of tests/warm_torchrun.py
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    half = torch.randn(16, 24, generator=gen(0))
    full = torch.cat([half, half]).to(BF16)  # two identical halves: one per shard in the sharded case
    results = {}
    for name, placements, seed in (
        ("replicated", [Replicate()], 5),
        ("rank_seeded", [Replicate()], rank),
        ("sharded", [Shard(0)], 5),
    ):
        p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, placements))
        opt = BF16AdamW([p], lr=1e-3, weight_decay=0.1, seed=seed)
        data = gen(100 + rank)  # each rank's own batch
        for _ in range(4):
            g = torch.randn(half.shape, generator=data)
            grad = torch.cat([g, g])
            dist.all_reduce(grad)  # data-parallel gradient averaging: every rank now holds the same gradient
            local = grad / world if placements[0].is_replicate() else (grad / world).chunk(world)[rank]
            p.grad = DTensor.from_local(local.to(BF16), mesh, placements)
            opt.step()
        m = opt.state[p]["exp_avg"]
        assert isinstance(m, DTensor) and m.placements == p.placements  # DCP can reshard the moments
        results[name] = p.to_local().clone()
        results[name + "_full"] = p.full_tensor()
    torch.save(results, f"{out}/rank{rank}.pt")


def test_replicas_stay_bit_identical_under_data_parallel_2(tmp_path, warm_torchrun):
    done = warm_torchrun.call(2, "test_precision:data_parallel_worker", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    start = torch.cat([torch.randn(16, 24, generator=gen(0))] * 2).to(BF16)
    assert not torch.equal(r0["replicated"], start)  # the replicas did train
    assert torch.equal(r0["replicated"], r1["replicated"])  # same seed: bit-identical replicas
    assert not torch.equal(r0["rank_seeded"], r1["rank_seeded"])  # what per-rank random bits would do: drift
    # Shards of identical values draw independent bits (their halves differ); both ranks see the same whole.
    assert r0["sharded"].shape == (16, 24) and not torch.equal(r0["sharded"], r1["sharded"])
    assert torch.equal(r0["sharded_full"], r1["sharded_full"])
    # Sharded and replicated runs round differently but follow the same trajectory (within a few bf16 spacings).
    sharded, replicated = r0["sharded_full"].float(), r0["replicated"].float()
    assert bool(((sharded - replicated).abs() <= 2**-5 * replicated.abs()).all())
