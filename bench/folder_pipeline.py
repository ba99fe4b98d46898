#!/usr/bin/env python3
"""torchvision's side of bench/folder_pipeline.sh: ImageFolder + DataLoader over DIR/train with the
ImageNet training transforms (RandomResizedCrop(SIZE) — bilinear, PIL's antialiased resize —
RandomHorizontalFlip, ToTensor, Normalize), WORKERS worker processes, batches of BATCH, one pass.
Prints one line like bench_folder's. Needs Debian's python3-torchvision.
  folder_pipeline.py DIR WORKERS [SIZE=224] [BATCH=64]"""
import sys
import time

import torch
from torchvision import datasets, transforms


def main():
    root, workers = sys.argv[1], int(sys.argv[2])
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 224
    batch = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    torch.set_num_threads(1)
    t = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = datasets.ImageFolder(root + "/train", transform=t)
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)
    start = time.perf_counter()
    images = 0
    for x, _ in dl:
        images += x.shape[0]
    s = time.perf_counter() - start
    print("torchvision workers={} images={} seconds={:.3f} images_per_second={:.1f}".format(workers, images, s,
                                                                                         images / s))


if __name__ == "__main__":
    main()
