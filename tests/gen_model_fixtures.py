#!/usr/bin/env python3
"""Generate the whole-model PyTorch fixtures for tests/nn_test.cpp.

Usage (from the repository root):
    /usr/bin/python3 tests/gen_model_fixtures.py            # (re)write tests/fixtures/model_*.safetensors
    /usr/bin/python3 tests/gen_model_fixtures.py --check    # regenerate in memory, compare, exit 1 on drift
    /usr/bin/python3 tests/gen_model_fixtures.py --out DIR  # write somewhere else

Files (the safetensors writer of tests/gen_fixtures.py is reused, so the layout is byte for byte
what tally::safetensors::write produces; everything is float32 on the CPU, deterministic):

model_resnet20_{batch,group,none}.safetensors
    He et al.'s CIFAR ResNet-20 (defined below with torchvision's module names; projection
    shortcut "downsample" = conv1x1 + norm when the shape changes), norm BatchNorm2d /
    GroupNorm(min(32, C/4), C) / Identity. Random weights (seeded from a CRC of the case name),
    non-trivial norm affine parameters and running statistics, num_batches_tracked = 3.
    Tensors: the full state dict under its own names, plus
      x                    input (2, 3, 32, 32)
      y                    eval-mode output (2, 10)
      y_train              train-mode output (batch statistics) (2, 10), from the state dict
      train_out.<buffer>   every buffer after that train-mode forward
model_resnet18.safetensors, model_resnet50.safetensors
    torchvision.models.resnet18 / resnet50 with num_classes = 10. The weights are too large to
    store, so they are given by a formula both sides compute: for the k-th tensor of
    model.state_dict() (0-based, state-dict order) with n elements, flattened index i,
        running_mean         0.1 * sin(i - k)
        running_var          1 + 0.1 * |cos(i + k)|
        num_batches_tracked  0
        anything else        0.05 * sin(0.37 * i + 1.3 * k)
    evaluated in float64 and rounded to float32. Tensors: x (2, 3, 64, 64) with
    x[i] = 0.5 * sin(0.01 * i) (flattened index) and the eval-mode output y (2, 10).
model_resnext_tiny.safetensors
    torchvision's own ResNet class at a small width, the ResNeXt bottleneck of tests/models_test.cpp:
    torchvision.models.resnet.ResNet(Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=4,
    num_classes=10) (block widths 16, 32, 64, 128; grouped 3x3 convolutions). Weights by the formula
    above (not stored). Tensors: x (2, 3, 64, 64) random, targets (2) int64, y the eval-mode output,
    y_train the train-mode output (batch statistics), loss = cross_entropy(y_train, targets) (mean),
    and grad.<name> for a few parameters after loss.backward() in train mode. The model runs in
    float64 (x is float32, exactly widened) and every result is rounded to float32 once: with these
    weights PyTorch's own float32 backward is off by up to 35% from its float64 one (layer1's
    downsample norm bias; tally's float32, whose norm statistics are double, is within 1e-4), so
    float32 PyTorch would not be a reference.
resnext50_32x4d_names.json (JSON, not safetensors)
    torchvision.models.resnext50_32x4d() at 1000 classes: its parameter count and its state dict's
    names and shapes in order ("state_dict": [[name, [shape...]], ...]), named_parameters() and
    named_buffers() names. No weights.

Every file's __metadata__ holds, as compact JSON:
    "state_dict"  [[name, [shape...]], ...] in state-dict order
    "parameters"  [name, ...] in named_parameters() order
    "buffers"     [name, ...] in named_buffers() order
and "model", "norm", "num_classes", "case", "torch_version".
"""

import argparse
import json
import math
import os
import sys
import zlib

import numpy as np
import torch
import torch.nn as nn
import torchvision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_fixtures import FIXTURE_DIR, emit, serialize  # noqa: E402

MAX_FILE_BYTES = 1_250_000


# ----------------------------------------------------------------------------------------------
# CIFAR ResNet (He et al. 2016, section 4.2) with torchvision's names


def make_norm(norm, c):
    if norm == "batch":
        return nn.BatchNorm2d(c)
    if norm == "group":
        return nn.GroupNorm(min(32, c // 4), c)
    return nn.Identity()


class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride, norm):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = make_norm(norm, planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = make_norm(norm, planes)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                                            make_norm(norm, planes))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class CifarResNet(nn.Module):
    def __init__(self, depth, num_classes=10, norm="batch", in_channels=3):
        super().__init__()
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn1 = make_norm(norm, 16)
        self.relu = nn.ReLU(inplace=True)
        in_planes = 16
        for idx, (planes, stride) in enumerate([(16, 1), (32, 2), (64, 2)]):
            blocks = []
            for b in range(n):
                blocks.append(BasicBlock(in_planes, planes, stride if b == 0 else 1, norm))
                in_planes = planes
            setattr(self, "layer%d" % (idx + 1), nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ----------------------------------------------------------------------------------------------
# helpers


def names_metadata(net, **extra):
    sd = net.state_dict()
    out = {
        "state_dict": json.dumps([[k, list(v.shape)] for k, v in sd.items()], separators=(",", ":")),
        "parameters": json.dumps([k for k, _ in net.named_parameters()], separators=(",", ":")),
        "buffers": json.dumps([k for k, _ in net.named_buffers()], separators=(",", ":")),
        "torch_version": torch.__version__,
    }
    out.update({k: str(v) for k, v in extra.items()})
    return out


def randomize(model):
    """Random weights with non-trivial norm parameters and running statistics."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                fan_in = m.weight[0].numel()
                m.weight.normal_(0.0, math.sqrt(2.0 / fan_in))
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.1)
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.normal_(0.0, 0.1)
                    m.running_var.uniform_(0.5, 2.0)
                    m.num_batches_tracked.fill_(3)
            elif isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 1.0 / math.sqrt(m.in_features))
                m.bias.normal_(0.0, 0.1)


def resnet20_case(norm):
    name = "model_resnet20_" + norm
    torch.manual_seed(zlib.crc32(name.encode("utf-8")))
    model = CifarResNet(20, num_classes=10, norm=norm)
    randomize(model)
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        model.eval()
        y = model(x)
        model.train()
        y_train = model(x)
    tensors["x"] = x
    tensors["y"] = y
    tensors["y_train"] = y_train
    for k, v in model.named_buffers():
        tensors["train_out." + k] = v.clone()
    meta = names_metadata(model, model="resnet20", norm=norm, num_classes=10, case=name)
    return name, serialize(tensors, meta)


def formula_value(name, k, n):
    i = np.arange(n, dtype=np.float64)
    if name.endswith("running_mean"):
        v = 0.1 * np.sin(i - k)
    elif name.endswith("running_var"):
        v = 1.0 + 0.1 * np.abs(np.cos(i + k))
    else:
        v = 0.05 * np.sin(0.37 * i + 1.3 * k)
    return v.astype(np.float32)


def torchvision_case(arch):
    name = "model_" + arch
    model = getattr(torchvision.models, arch)(num_classes=10)
    sd = model.state_dict()
    new_sd = {}
    for k, (key, t) in enumerate(sd.items()):
        if key.endswith("num_batches_tracked"):
            new_sd[key] = torch.zeros_like(t)
        else:
            new_sd[key] = torch.from_numpy(formula_value(key, k, t.numel())).reshape(t.shape)
    model.load_state_dict(new_sd)
    n = 2 * 3 * 64 * 64
    x = torch.from_numpy((0.5 * np.sin(0.01 * np.arange(n, dtype=np.float64))).astype(np.float32))
    x = x.reshape(2, 3, 64, 64)
    model.eval()
    with torch.no_grad():
        y = model(x)
    meta = names_metadata(model, model=arch, norm="batch", num_classes=10, case=name)
    return name, serialize({"x": x, "y": y}, meta)


RESNEXT_TINY_GRADS = ["conv1.weight", "layer1.0.conv2.weight", "layer1.0.downsample.1.bias", "layer2.0.conv2.weight",
                      "layer4.0.conv2.weight", "layer4.0.bn3.weight", "fc.weight", "fc.bias"]


def formula_state_dict(model):
    new_sd = {}
    for k, (key, t) in enumerate(model.state_dict().items()):
        if key.endswith("num_batches_tracked"):
            new_sd[key] = torch.zeros_like(t)
        else:
            new_sd[key] = torch.from_numpy(formula_value(key, k, t.numel())).reshape(t.shape)
    return new_sd


def resnext_tiny_case():
    name = "model_resnext_tiny"
    torch.manual_seed(zlib.crc32(name.encode("utf-8")))
    from torchvision.models.resnet import Bottleneck, ResNet
    model = ResNet(Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=4, num_classes=10)
    model.load_state_dict(formula_state_dict(model))
    names = names_metadata(model)  # before the conversion: the float32 model's state dict
    model = model.double()
    x = torch.randn(2, 3, 64, 64)
    targets = torch.tensor([3, 7], dtype=torch.int64)
    model.eval()
    with torch.no_grad():
        y = model(x.double())
    model.train()
    y_train = model(x.double())
    loss = nn.functional.cross_entropy(y_train, targets)
    loss.backward()
    params = dict(model.named_parameters())
    f32 = lambda t: t.detach().to(torch.float32)  # noqa: E731
    tensors = {"x": x, "targets": targets, "y": f32(y), "y_train": f32(y_train), "loss": f32(loss)}
    for k in RESNEXT_TINY_GRADS:
        tensors["grad." + k] = f32(params[k].grad)
    names.update(model="resnext_tiny", norm="batch", num_classes="10", case=name, groups="4", width_per_group="4",
                 layers="1,1,1,1", computed_in="float64", torchvision_version=torchvision.__version__)
    return name, serialize(tensors, names)


def resnext50_names_case():
    model = torchvision.models.resnext50_32x4d()
    def one_per_line(items):
        return "[\n" + ",\n".join(items) + "\n]"

    lines = ['{', '"model": "resnext50_32x4d",',
             '"source": "torchvision.models.resnext50_32x4d() (num_classes 1000)",',
             '"torchvision_version": %s,' % json.dumps(torchvision.__version__),
             '"parameter_count": %d,' % sum(p.numel() for p in model.parameters()),
             '"parameters": %s,' % one_per_line([json.dumps(k) for k, _ in model.named_parameters()]),
             '"buffers": %s,' % one_per_line([json.dumps(k) for k, _ in model.named_buffers()]),
             '"state_dict": %s' % one_per_line(['[%s,%s]' % (json.dumps(k), json.dumps(list(v.shape)))
                                                 for k, v in model.state_dict().items()]),
             '}']
    return "resnext50_32x4d_names", ("\n".join(lines) + "\n").encode("utf-8")


BUILDERS = {
    "model_resnet20_batch": lambda: resnet20_case("batch"),
    "model_resnet20_group": lambda: resnet20_case("group"),
    "model_resnet20_none": lambda: resnet20_case("none"),
    "model_resnet18": lambda: torchvision_case("resnet18"),
    "model_resnet50": lambda: torchvision_case("resnet50"),
    "model_resnext_tiny": resnext_tiny_case,
    "resnext50_32x4d_names": resnext50_names_case,
}

EXTENSIONS = {"resnext50_32x4d_names": ".json"}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=FIXTURE_DIR, help="output directory")
    parser.add_argument("--check", action="store_true",
                        help="compare against the files in --out instead of writing")
    parser.add_argument("cases", nargs="*", help="cases to build (default: all)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    names = args.cases or list(BUILDERS)
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        parser.error("unknown case(s): %s" % ", ".join(unknown))
    os.makedirs(args.out, exist_ok=True)

    bad = 0
    for case in names:
        name, payload = BUILDERS[case]()
        path = os.path.join(args.out, name + EXTENSIONS.get(case, ".safetensors"))
        bad += emit(path, payload, args.check, MAX_FILE_BYTES)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
