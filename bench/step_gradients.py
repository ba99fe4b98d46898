#!/usr/bin/env python3
"""bench/step_gradients.py — one training step's gradients of tally and PyTorch against float64,
from the same weights on the same batch: how far each precision's gradients are from exact, per
parameter, side by side.

    /usr/bin/python3 bench/step_gradients.py [--seed 0] [--batch 512] [--weights W.safetensors]

The model is make train's (CIFAR ResNet-20, batch norm, 1 input channel, 10 classes), initialized
by PyTorch (kaiming_normal_ fan_out convolutions, --seed), or read from --weights (a `tally train
--save` file: weights from later in training), and written as safetensors for `tally train --init`; the batch is Fashion-MNIST's first --batch training images (tally:
--no-shuffle --no-augment, the whole batch at once). tally's gradient is read back from one SGD
step with lr 1, no momentum and no weight decay (g = w0 - w1). PyTorch runs float64 (the
reference), float32 and bf16 autocast (loss in float32); tally runs fp32 and bf16. Printed: the
norm-wise relative error ||g - g64|| / ||g64|| of every parameter's gradient, and their mean.

--sources adds three float64 columns that round to bfloat16 at one place each — "W": the
convolution and linear weights, as a bf16 forward sees them (the gradient taken at the rounded
weights); "A": every stored activation (the input, each convolution, norm, ReLU, residual sum,
pooled features and logits); "G": the gradient of each of those activations, flowing back — so
that the bf16 error can be traced to what bf16 storage rounds. All three at once comes close to
PyTorch's bf16 column (0.156 against 0.159 at seed 0's init; autocast also rounds its weight
gradients to bf16).
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)
from gen_fixtures import serialize  # noqa: E402
from gen_model_fixtures import CifarResNet  # noqa: E402
from fashion_mnist_pytorch import load  # noqa: E402


def torch_grads(state, x, y, mode):
    m = CifarResNet(20, 10, "batch", in_channels=1)
    m.load_state_dict(state)
    m.train()
    if mode == "f64":
        m, x = m.double(), x.double()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
        out = m(x)
    F.cross_entropy(out if mode == "f64" else out.float(), y).backward()
    return {k: p.grad.double() for k, p in m.named_parameters()}


def round_bf16(t):
    return t.to(torch.bfloat16).to(t.dtype)


class RoundValue(torch.autograd.Function):
    """Rounds in the forward, passes the gradient through (a bf16 activation's value)."""
    @staticmethod
    def forward(ctx, x):
        return round_bf16(x)

    @staticmethod
    def backward(ctx, g):
        return g


class RoundGradient(torch.autograd.Function):
    """Passes the value through, rounds the gradient flowing back (a bf16 activation gradient)."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return round_bf16(g)


def emulated_grads(state, x, y, where):
    """float64 gradients with bf16 rounding at `where` (a set of "W", "A", "G"); see --sources."""
    m = CifarResNet(20, 10, "batch", in_channels=1).double()
    m.load_state_dict(state)
    m.train()
    if "W" in where:
        with torch.no_grad():
            for mod in m.modules():
                if isinstance(mod, (nn.Conv2d, nn.Linear)):
                    mod.weight.copy_(round_bf16(mod.weight))

    def store(t):
        if "A" in where:
            t = RoundValue.apply(t)
        return RoundGradient.apply(t) if "G" in where else t

    stored = (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Linear, nn.AdaptiveAvgPool2d, type(m.layer1[0]))
    for mod in m.modules():
        if isinstance(mod, stored):
            if isinstance(mod, nn.ReLU):
                mod.inplace = False
            mod.register_forward_hook(lambda mod, inp, out: store(out))
    F.cross_entropy(m(store(x.double())), y).backward()
    return {k: p.grad.double() for k, p in m.named_parameters()}


def read_f32(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header, base = json.loads(b[8:8 + n]), 8 + n
    out = {}
    for k, e in header.items():
        if k != "__metadata__" and e["dtype"] == "F32":
            s, t = e["data_offsets"]
            out[k] = torch.from_numpy(np.frombuffer(b[base + s:base + t], dtype=np.float32).reshape(e["shape"]).copy())
    return out


def tally_grads(args, init, state, precision, tmp):
    saved = os.path.join(tmp, f"w1_{precision}.safetensors")
    subprocess.run([args.tally, "train", "--model", "resnet20", "--data", "fashion-mnist", "--init", init,
                    "--steps", "1", "--batch-size", str(args.batch), "--lr", "1", "--schedule", "constant",
                    "--momentum", "0", "--weight-decay", "0", "--no-shuffle", "--no-augment", "--memory-limit", "4GiB",
                    "--no-eval", "--no-progress", "--threads", str(args.threads), "--precision", precision,
                    "--save", saved, "--out", os.path.join(tmp, f"run_{precision}")], check=True, stdout=subprocess.DEVNULL)
    w1 = read_f32(saved)
    return {k: state[k].double() - w1[k].double() for k in w1}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tally", default=os.path.join(ROOT, "build", "apps", "tally"))
    p.add_argument("--dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--sources", action="store_true", help="add float64 columns rounding weights, activations or gradients alone")
    p.add_argument("--weights", help="start from these weights (safetensors, torchvision names) instead of an init")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = CifarResNet(20, 10, "batch", in_channels=1)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if args.weights:
        saved = read_f32(args.weights)
        missing = [k for k, v in state.items() if v.is_floating_point() and k not in saved]
        if missing:
            raise SystemExit(f"{args.weights}: expected float32 tensors for {', '.join(missing[:3])}, found none")
        state.update({k: saved[k] for k in state if k in saved})
    xtr, ytr = load(args.dir, "train")
    x, y = xtr[:args.batch], ytr[:args.batch]
    ref = torch_grads(state, x, y, "f64")
    cols = {"torch f32": torch_grads(state, x, y, "f32"), "torch bf16": torch_grads(state, x, y, "bf16")}
    if args.sources:
        for where in ("W", "A", "G", "WAG"):
            cols[f"f64 bf16 {where}"] = emulated_grads(state, x, y, set(where))
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "w0.safetensors")
        with open(init, "wb") as f:
            f.write(serialize({k: v.numpy() for k, v in state.items()}, {}))
        cols["tally fp32"] = tally_grads(args, init, state, "fp32", tmp)
        cols["tally bf16"] = tally_grads(args, init, state, "bf16", tmp)
    names = list(cols)
    start = args.weights or f"PyTorch's init, seed {args.seed}"
    print(f"gradient error against float64, one step from {start}, batch {args.batch}")
    print(f"{'parameter':36}" + "".join(f"{c:>13}" for c in names))
    total = dict.fromkeys(names, 0.0)
    for k, g in ref.items():
        row = {c: ((cols[c][k] - g).norm() / g.norm()).item() for c in names}
        for c in names:
            total[c] += row[c]
        print(f"{k:36}" + "".join(f"{row[c]:13.4f}" for c in names))
    print(f"{'mean':36}" + "".join(f"{total[c] / len(ref):13.4f}" for c in names))


if __name__ == "__main__":
    main()
