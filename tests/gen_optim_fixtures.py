#!/usr/bin/env python3
"""Generate the optimizer and learning-rate-schedule fixtures (tests/fixtures/optim_*.safetensors).

Usage (from the repository root):
    /usr/bin/python3 tests/gen_optim_fixtures.py            # (re)write tests/fixtures/optim_*
    /usr/bin/python3 tests/gen_optim_fixtures.py --check    # regenerate in memory, exit 1 on drift
    /usr/bin/python3 tests/gen_optim_fixtures.py --out DIR  # write somewhere else

Optimizer cases (one file each, read by tests/optim_test.cpp):

    optim_sgd               SGD lr 0.1
    optim_sgd_momentum_wd   SGD lr 0.1, momentum 0.9, weight_decay 5e-4
    optim_sgd_nesterov      SGD lr 0.1, momentum 0.9, nesterov
    optim_sgd_dampening     SGD lr 0.1, momentum 0.9, dampening 0.1
    optim_adamw             AdamW with PyTorch's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
                            weight_decay 1e-2)
    optim_adamw_wd          AdamW lr 1e-2, betas (0.8, 0.99), eps 1e-6, weight_decay 0.1

Each holds two parameters, k = 0 of shape (3, 4) and k = 1 of shape (5), and four steps:

    param.init.<k>     F32  the parameter before the first step
    grad.<s>.<k>       F32  the gradient set before step s (s = 0..3), random
    param.<s>.<k>      F32  the parameter after step s, torch.optim in float32
    param64.<s>.<k>    F64  the same run in float64 (initial values and gradients converted exactly)

and the options in __metadata__ ("optimizer" = sgd|adamw, "lr", "momentum", ..., "steps").

Schedule cases (one file, optim_lr_schedules.safetensors): for each case <c>, `lr.<c>` (F64,
shape (total_steps)) is the learning rate PyTorch's scheduler gives the optimizer for step
0, 1, ..., total_steps - 1 when scheduler.step() is called once after every optimizer step, and
the metadata "<c>.<option>" holds the tally::optim::ScheduleOptions that must reproduce it
(kind, base_lr, total_steps, warmup_steps, step_size, gamma, eta_min, onecycle_*).
Linear warm-up is PyTorch's SequentialLR([LinearLR(start_factor=1/W, total_iters=W-1), <main>],
milestones=[W]); the script asserts that every PyTorch sequence equals the closed form documented
in optim/schedule.h to 1e-12 relative, so the fixture and the documentation cannot drift apart.

The safetensors writer is the one in tests/gen_fixtures.py (byte-identical to the C++ writer).
Every case seeds torch from a CRC of its name and runs single-threaded, so the output is
reproducible byte for byte.
"""

import argparse
import math
import os
import sys
import warnings
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_fixtures import FIXTURE_DIR, MAX_FILE_BYTES, fmt, emit, serialize  # noqa: E402

SHAPES = [(3, 4), (5,)]
STEPS = 4


def meta(**kw):
    out = {k: fmt(v) for k, v in kw.items()}
    out["torch_version"] = torch.__version__
    return out


# ----------------------------------------------------------------------------------------------
# optimizers


def run_optimizer(make_opt, init, grads, dtype):
    """Runs make_opt(params) for len(grads) steps; returns the parameters after each step."""
    params = [p.detach().to(dtype).clone().requires_grad_(True) for p in init]
    opt = make_opt(params)
    after = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype).clone()
        opt.step()
        after.append([p.detach().clone() for p in params])
    return after


def optimizer_case(name, optimizer, **options):
    torch.manual_seed(zlib.crc32(name.encode("utf-8")))
    init = [torch.randn(*s, dtype=torch.float32) for s in SHAPES]
    grads = [[torch.randn(*s, dtype=torch.float32) for s in SHAPES] for _ in range(STEPS)]

    if optimizer == "sgd":
        def make_opt(params):
            return torch.optim.SGD(params, lr=options["lr"], momentum=options["momentum"],
                                   dampening=options["dampening"],
                                   weight_decay=options["weight_decay"],
                                   nesterov=options["nesterov"])
    else:
        def make_opt(params):
            return torch.optim.AdamW(params, lr=options["lr"],
                                     betas=(options["beta1"], options["beta2"]),
                                     eps=options["eps"], weight_decay=options["weight_decay"])

    after32 = run_optimizer(make_opt, init, grads, torch.float32)
    after64 = run_optimizer(make_opt, init, grads, torch.float64)
    tensors = {}
    for k, p in enumerate(init):
        tensors["param.init.%d" % k] = p
    for s in range(STEPS):
        for k in range(len(SHAPES)):
            tensors["grad.%d.%d" % (s, k)] = grads[s][k]
            tensors["param.%d.%d" % (s, k)] = after32[s][k]
            tensors["param64.%d.%d" % (s, k)] = after64[s][k]
    return tensors, meta(optimizer=optimizer, steps=STEPS, num_params=len(SHAPES), **options)


def sgd_options(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    return dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                nesterov=nesterov)


def adamw_options(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2):
    return dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)


OPTIMIZER_CASES = {
    "optim_sgd": ("sgd", sgd_options()),
    "optim_sgd_momentum_wd": ("sgd", sgd_options(momentum=0.9, weight_decay=5e-4)),
    "optim_sgd_nesterov": ("sgd", sgd_options(momentum=0.9, nesterov=True)),
    "optim_sgd_dampening": ("sgd", sgd_options(momentum=0.9, dampening=0.1)),
    "optim_adamw": ("adamw", adamw_options()),
    "optim_adamw_wd": ("adamw", adamw_options(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6,
                                              weight_decay=0.1)),
}


# ----------------------------------------------------------------------------------------------
# learning-rate schedules


def schedule_options(kind, base_lr=0.1, total_steps=20, warmup_steps=0, step_size=0, gamma=0.1,
                     eta_min=0.0, pct_start=0.3, div_factor=25.0, final_div_factor=1e4):
    return dict(kind=kind, base_lr=base_lr, total_steps=total_steps, warmup_steps=warmup_steps,
                step_size=step_size, gamma=gamma, eta_min=eta_min, onecycle_pct_start=pct_start,
                onecycle_div_factor=div_factor, onecycle_final_div_factor=final_div_factor)


SCHEDULE_CASES = {
    "constant": schedule_options("constant"),
    "constant_warmup": schedule_options("constant", warmup_steps=5),
    "step": schedule_options("step", step_size=7, gamma=0.5),
    "step_default_size": schedule_options("step", total_steps=20),  # step_size 20 // 3 = 6
    "step_warmup": schedule_options("step", warmup_steps=4, step_size=5, gamma=0.5),
    "cosine": schedule_options("cosine"),
    "cosine_eta_min": schedule_options("cosine", eta_min=0.01),
    "cosine_warmup": schedule_options("cosine", warmup_steps=5, eta_min=1e-3),
    "onecycle": schedule_options("onecycle"),
    "onecycle_custom": schedule_options("onecycle", base_lr=0.4, total_steps=24, pct_start=0.25,
                                        div_factor=10.0, final_div_factor=100.0),
}


def torch_lrs(o):
    """The lr PyTorch's scheduler sets for each of o['total_steps'] optimizer steps."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=o["base_lr"])
    total, warm = o["total_steps"], o["warmup_steps"]
    kind = o["kind"]
    if kind == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=o["base_lr"], total_steps=total, pct_start=o["onecycle_pct_start"],
            anneal_strategy="cos", cycle_momentum=False, div_factor=o["onecycle_div_factor"],
            final_div_factor=o["onecycle_final_div_factor"], three_phase=False)
    else:
        if kind == "constant":
            main = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)
        elif kind == "step":
            size = o["step_size"] or total // 3
            main = torch.optim.lr_scheduler.StepLR(opt, step_size=size, gamma=o["gamma"])
        elif kind == "cosine":
            main = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warm,
                                                              eta_min=o["eta_min"])
        else:
            raise ValueError(kind)
        if warm > 0:
            assert warm >= 2, "LinearLR needs total_iters >= 1"
            # factor(i) = 1/W + (1 - 1/W) * i / (W - 1) = (i + 1) / W for i < W; SequentialLR
            # resets the lr to base_lr and restarts `main` at its step 0 on the milestone W.
            ramp = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / warm, end_factor=1.0,
                                                     total_iters=warm - 1)
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [ramp, main], milestones=[warm])
        else:
            sched = main
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return np.array(lrs, dtype=np.float64)


def documented_lr(o, step):
    """The closed forms of optim/schedule.h, written independently of PyTorch."""
    base, total, warm = o["base_lr"], o["total_steps"], o["warmup_steps"]
    kind = o["kind"]
    if kind == "onecycle":
        initial = base / o["onecycle_div_factor"]
        final = initial / o["onecycle_final_div_factor"]
        end1 = o["onecycle_pct_start"] * total - 1.0
        end2 = total - 1.0

        def cos_anneal(a, b, pct):
            return b + (a - b) / 2.0 * (math.cos(math.pi * pct) + 1.0)

        if step <= end1:
            return cos_anneal(initial, base, step / end1)
        return cos_anneal(base, final, (step - end1) / (end2 - end1))
    if step < warm:
        return base * (step + 1) / warm
    t = step - warm
    if kind == "constant":
        return base
    if kind == "step":
        size = o["step_size"] or total // 3
        return base * o["gamma"] ** (t // size)
    if kind == "cosine":
        T = total - warm
        return o["eta_min"] + (base - o["eta_min"]) * (1.0 + math.cos(math.pi * t / T)) / 2.0
    raise ValueError(kind)


def schedules_case():
    tensors, metadata = {}, {}
    for name, o in SCHEDULE_CASES.items():
        lrs = torch_lrs(o)
        for step, lr in enumerate(lrs):
            want = documented_lr(o, step)
            if abs(lr - want) > 1e-12 * abs(want):
                raise RuntimeError("schedule %s step %d: torch %r, documented formula %r" % (
                    name, step, lr, want))
        tensors["lr." + name] = lrs
        for k, v in o.items():
            metadata["%s.%s" % (name, k)] = fmt(v)
    metadata["cases"] = ",".join(SCHEDULE_CASES)
    metadata["torch_version"] = torch.__version__
    return tensors, metadata


# ----------------------------------------------------------------------------------------------


def build_all():
    out = {}
    for name, (optimizer, options) in OPTIMIZER_CASES.items():
        tensors, metadata = optimizer_case(name, optimizer, **options)
        metadata["case"] = name
        out[name] = serialize(tensors, metadata)
    tensors, metadata = schedules_case()
    metadata["case"] = "optim_lr_schedules"
    out["optim_lr_schedules"] = serialize(tensors, metadata)
    return out


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=FIXTURE_DIR, help="output directory")
    parser.add_argument("--check", action="store_true",
                        help="compare against the files in --out instead of writing")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # SequentialLR restarts the second scheduler with step(0), which PyTorch flags as deprecated.
    warnings.filterwarnings("ignore", message="The epoch parameter")
    os.makedirs(args.out, exist_ok=True)

    total, bad = 0, 0
    for name, payload in build_all().items():
        total += len(payload)
        bad += emit(os.path.join(args.out, name + ".safetensors"), payload, args.check, MAX_FILE_BYTES)
    print("%d file(s), %d bytes in all%s" % (len(OPTIMIZER_CASES) + 1, total,
                                            (", %d differ" % bad) if args.check else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
