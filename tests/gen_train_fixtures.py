#!/usr/bin/env python3
"""Fixtures for the `tally train` equivalence test (tests/train_test.cpp).

Writes into tests/fixtures/train/:
  tiny_cifar10/           a CIFAR-10-format data set (data_batch_1..5.bin with 16 images each,
                          test_batch.bin with 16) of random pixels and labels
  init_<norm>.safetensors PyTorch-initialized CIFAR ResNet-20 (torchvision names), norm batch|group|none
  final_<norm>.safetensors the same model after STEPS steps of torch.optim.SGD(lr, momentum,
                          weight_decay) on batches [kB, (k+1)B) in file order, pixels / 255, no
                          augmentation, no normalization, cross-entropy averaged over the batch

Run: /usr/bin/python3 tests/gen_train_fixtures.py   (needs torch; CI only reads the files)
"""
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_fixtures import serialize, write_atomic  # noqa: E402
from gen_model_fixtures import CifarResNet  # noqa: E402  (torchvision names)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "train")
STEPS, BATCH, LR, MOMENTUM, WD = 2, 16, 0.01, 0.9, 5e-4


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_cifar(path, labels, pixels):
    with open(path, "wb") as f:
        for y, p in zip(labels, pixels):
            f.write(bytes([int(y)]) + p.tobytes())


def main():
    torch.set_num_threads(1)
    os.makedirs(os.path.join(OUT, "tiny_cifar10"), exist_ok=True)
    rng = np.random.RandomState(20261121)
    train_px, train_y = [], []
    for i in range(1, 6):
        px = rng.randint(0, 256, size=(16, 3 * 32 * 32), dtype=np.uint8)
        y = rng.randint(0, 10, size=16)
        write_cifar(os.path.join(OUT, "tiny_cifar10", "data_batch_%d.bin" % i), y, px)
        train_px.append(px)
        train_y.append(y)
    px = rng.randint(0, 256, size=(16, 3 * 32 * 32), dtype=np.uint8)
    y = rng.randint(0, 10, size=16)
    write_cifar(os.path.join(OUT, "tiny_cifar10", "test_batch.bin"), y, px)
    images = torch.from_numpy(np.concatenate(train_px).astype(np.float32) / 255.0).view(-1, 3, 32, 32)
    labels = torch.from_numpy(np.concatenate(train_y).astype(np.int64))

    for norm in ("batch", "group", "none"):
        torch.manual_seed({"batch": 1, "group": 2, "none": 3}[norm])
        model = CifarResNet(20, norm=norm)
        init = state(model)
        write_atomic(os.path.join(OUT, "init_%s.safetensors" % norm), serialize(init, {"norm": norm}))
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
        model.train()
        for k in range(STEPS):
            n = images.shape[0]
            idx = [(k * BATCH + i) % n for i in range(BATCH)]
            loss = F.cross_entropy(model(images[idx]), labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        meta = {"norm": norm, "steps": str(STEPS), "batch_size": str(BATCH), "lr": str(LR), "momentum": str(MOMENTUM),
                "weight_decay": str(WD), "torch_version": torch.__version__}
        write_atomic(os.path.join(OUT, "final_%s.safetensors" % norm), serialize(state(model), meta))
        print(norm, "final loss", float(loss))


if __name__ == "__main__":
    main()
