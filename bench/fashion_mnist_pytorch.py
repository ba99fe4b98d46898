#!/usr/bin/env python3
"""PyTorch reference for `make train`'s recipe: ResNet-20 on Fashion-MNIST, same model, batch,
schedule and data order rule as tally, with the batch in one piece (PyTorch has no memory limit
to meet on the CPU). Prints test accuracy per epoch and a JSON line with the results.

Recipe (as the Makefile's `train` target): CIFAR ResNet-20 (torchvision names, batch norm,
kaiming_normal_(fan_out, relu) convolutions), 1 input channel, 10 classes; SGD momentum 0.9,
weight decay 5e-4; batch 512; lr 0.4 (0.1 x 512/128) with a linear warm-up over the first half
epoch, lr(step) = lr * (step + 1) / W for step < W, then cosine to 0 over the remaining steps;
pixels / 255 normalized with mean 0.2860, std 0.3530; no augmentation; the training set reshuffled
every epoch and the last partial batch dropped (tally's rule; the permutations themselves differ).

Run: /usr/bin/python3 bench/fashion_mnist_pytorch.py [--epochs 2] [--threads 2] [--seed 0] [--precision bf16]
(bf16: the forward, evaluation included, under CPU autocast, the loss in float32 — the mode a
PyTorch user picks for bf16 mixed precision).
"""
import argparse
import gzip
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from gen_model_fixtures import CifarResNet  # noqa: E402


def read_idx(path, magic):
    with gzip.open(path, "rb") as f:
        data = f.read()
    m, n = int.from_bytes(data[0:4], "big"), int.from_bytes(data[4:8], "big")
    if m != magic:
        raise SystemExit(f"{path}: expected magic {magic:#010x}, found {m:#010x}")
    if magic == 0x803:
        rows, cols = int.from_bytes(data[8:12], "big"), int.from_bytes(data[12:16], "big")
        return np.frombuffer(data, np.uint8, offset=16).reshape(n, 1, rows, cols)
    return np.frombuffer(data, np.uint8, offset=8).astype(np.int64)


def load(d, split):
    x = read_idx(os.path.join(d, f"{split}-images-idx3-ubyte.gz"), 0x803)
    y = read_idx(os.path.join(d, f"{split}-labels-idx1-ubyte.gz"), 0x801)
    x = (torch.from_numpy(x.astype(np.float32) / 255.0) - 0.2860) / 0.3530
    return x, torch.from_numpy(y)


def lr_at(step, base, warm, total):
    if step < warm:
        return base * (step + 1) / warm
    return base * (1 + math.cos(math.pi * (step - warm) / (total - warm))) / 2


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.4)
    p.add_argument("--warmup-epochs", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: the forward under torch.autocast('cpu', torch.bfloat16), the loss in float32")
    a = p.parse_args()
    bf16 = a.precision == "bf16"
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    xtr, ytr = load(a.dir, "train")
    xte, yte = load(a.dir, "t10k")
    model = CifarResNet(20, 10, "batch", in_channels=1)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, weight_decay=5e-4)
    per_epoch = len(xtr) // a.batch_size
    total, warm = a.epochs * per_epoch, round(a.warmup_epochs * per_epoch)
    rng = np.random.default_rng(a.seed)
    step, t0, acc = 0, time.time(), 0.0
    for epoch in range(a.epochs):
        model.train()
        order = torch.from_numpy(rng.permutation(len(xtr)))
        for k in range(per_epoch):
            idx = order[k * a.batch_size:(k + 1) * a.batch_size]
            for g in opt.param_groups:
                g["lr"] = lr_at(step, a.lr, warm, total)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(xtr[idx])
            loss = F.cross_entropy(logits.float(), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 20 == 0:
                print(f"epoch {epoch + 1}/{a.epochs} step {step}/{total} loss {loss.item():.4f} "
                      f"| {step * a.batch_size / (time.time() - t0):.1f} img/s", flush=True)
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(xte), 1000):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logits = model(xte[i:i + 1000])
                correct += (logits.float().argmax(1) == yte[i:i + 1000]).sum().item()
        acc = correct / len(xte)
        print(f"epoch {epoch + 1}/{a.epochs}: test accuracy {100 * acc:.2f}%", flush=True)
    print(json.dumps({"torch": torch.__version__, "epochs": a.epochs, "batch_size": a.batch_size, "lr": a.lr,
                      "test_accuracy": acc, "seconds": round(time.time() - t0, 1), "threads": a.threads,
                      "seed": a.seed, "precision": a.precision}))


if __name__ == "__main__":
    main()
