#!/usr/bin/env python3
"""Generate tally's PyTorch golden fixtures (tests/fixtures/*.safetensors).

Usage (from the repository root):
    /usr/bin/python3 tests/gen_fixtures.py            # (re)write tests/fixtures/
    /usr/bin/python3 tests/gen_fixtures.py --check    # regenerate in memory, compare, exit 1 on drift
    /usr/bin/python3 tests/gen_fixtures.py --out DIR  # write somewhere else

Each case is one file <case>.safetensors holding the forward inputs, the upstream gradient
`dy`, the outputs and "grad.<input>" for every input that requires grad, all float32 (class
targets int64), computed by PyTorch in float32 on the CPU. Operator options are stored as
strings in __metadata__. See tests/fixtures/README.md for the conventions.

The safetensors format is written here directly (json + struct + numpy; the `safetensors`
package is not needed), byte for byte the way core/safetensors.cpp writes it: "__metadata__"
first with sorted keys, then the tensors in name order, each entry as
{"dtype","shape","data_offsets"}, compact JSON padded with spaces to a multiple of 8 bytes, and
the data laid out in name order. Every case seeds torch from a CRC of its name and PyTorch runs
single-threaded and deterministic, so re-running the script reproduces identical files.
"""

import argparse
import json
import os
import struct
import sys
import zlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXTURE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

MAX_FILE_BYTES = 64 * 1024
MAX_TOTAL_BYTES = 3 * 512 * 1024  # 1.5 MiB

_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint8): "U8",
}


# ----------------------------------------------------------------------------------------------
# safetensors writer


def _to_numpy(value):
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    arr = np.asarray(value)
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d scalar into 1-d)
        arr = arr.copy(order="C")
    if arr.dtype not in _DTYPES:
        raise TypeError("unsupported dtype %s" % arr.dtype)
    return arr


def serialize(tensors, metadata):
    """The bytes of a safetensors file holding `tensors` (name -> array) and `metadata`."""
    parts = []
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError("metadata must map str -> str, got %r: %r" % (k, v))
        parts.append('"__metadata__":' + json.dumps(metadata, sort_keys=True,
                                                    separators=(",", ":"), ensure_ascii=False))
    blobs = []
    offset = 0
    for name in sorted(tensors):
        if name == "__metadata__":
            raise ValueError("'__metadata__' cannot name a tensor")
        arr = _to_numpy(tensors[name])
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
        parts.append('%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}' % (
            json.dumps(name, ensure_ascii=False), _DTYPES[arr.dtype],
            ",".join(str(int(d)) for d in arr.shape), offset, offset + len(data)))
        blobs.append(data)
        offset += len(data)
    header = ("{" + ",".join(parts) + "}").encode("utf-8")
    header += b" " * ((8 - len(header) % 8) % 8)
    return struct.pack("<Q", len(header)) + header + b"".join(blobs)


def write_atomic(path, payload):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def emit(path, payload, check, max_bytes):
    """Writes `payload` to `path` (atomically), or with `check` compares it with the file there.
    Returns True when checking found the file different or missing."""
    if len(payload) > max_bytes:
        raise RuntimeError("%s is %d bytes, over the %d byte limit" % (path, len(payload), max_bytes))
    if check:
        try:
            with open(path, "rb") as f:
                same = f.read() == payload
        except FileNotFoundError:
            same = False
        if not same:
            print("DIFFERS: %s" % path)
        return not same
    write_atomic(path, payload)
    print("%8d  %s" % (len(payload), path))
    return False


# ----------------------------------------------------------------------------------------------
# helpers


def seed_for(name):
    torch.manual_seed(zlib.crc32(name.encode("utf-8")))


def leaf(t):
    """A float32 leaf tensor that requires grad."""
    return t.detach().to(torch.float32).clone().requires_grad_(True)


def randn(*shape):
    return torch.randn(*shape, dtype=torch.float32)


def backward_with_dy(y):
    dy = randn(*y.shape)
    y.backward(dy)
    return dy


def fmt(v):
    """A metadata value: str(v), with booleans spelled true/false."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def meta(**kw):
    out = {k: fmt(v) for k, v in kw.items()}
    out["torch_version"] = torch.__version__
    return out


CASES = {}


def case(fn):
    """Registers fn as the case named after it (a trailing underscore is dropped: sum_ -> sum)."""
    CASES[fn.__name__.rstrip("_")] = fn
    return fn


# ----------------------------------------------------------------------------------------------
# convolution, linear, matmul


def conv_case(name, n, c, h, w, k, ksize, stride, padding, dilation, groups, bias):
    seed_for(name)
    x = leaf(randn(n, c, h, w))
    wt = leaf(randn(k, c // groups, ksize, ksize) * 0.3)
    b = leaf(randn(k)) if bias else None
    y = F.conv2d(x, wt, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
    dy = backward_with_dy(y)
    t = {"x": x, "w": wt, "y": y, "dy": dy, "grad.x": x.grad, "grad.w": wt.grad}
    if bias:
        t["b"] = b
        t["grad.b"] = b.grad
    return t, meta(op="conv2d", stride=stride, padding=padding, dilation=dilation, groups=groups,
                   bias=bias)


@case
def conv2d_basic():
    return conv_case("conv2d_basic", 2, 3, 7, 6, 4, 3, stride=1, padding=1, dilation=1, groups=1,
                     bias=True)


@case
def conv2d_stride2_pad2_dil2():
    return conv_case("conv2d_stride2_pad2_dil2", 2, 4, 9, 8, 3, 3, stride=2, padding=2,
                     dilation=2, groups=1, bias=False)


@case
def conv2d_groups2():
    return conv_case("conv2d_groups2", 2, 4, 5, 5, 6, 3, stride=1, padding=1, dilation=1,
                     groups=2, bias=True)


@case
def conv2d_depthwise():
    return conv_case("conv2d_depthwise", 1, 3, 6, 6, 3, 3, stride=2, padding=1, dilation=1,
                     groups=3, bias=True)


@case
def conv2d_1x1():
    return conv_case("conv2d_1x1", 2, 5, 4, 4, 3, 1, stride=1, padding=0, dilation=1, groups=1,
                     bias=False)


@case
def linear():
    seed_for("linear")
    x, w, b = leaf(randn(5, 7)), leaf(randn(4, 7)), leaf(randn(4))
    y = F.linear(x, w, b)
    dy = backward_with_dy(y)
    return ({"x": x, "w": w, "b": b, "y": y, "dy": dy, "grad.x": x.grad, "grad.w": w.grad,
             "grad.b": b.grad}, meta(op="linear"))


@case
def matmul():
    seed_for("matmul")
    a, b = leaf(randn(3, 5)), leaf(randn(5, 4))
    y = a @ b
    dy = backward_with_dy(y)
    return ({"a": a, "b": b, "y": y, "dy": dy, "grad.a": a.grad, "grad.b": b.grad},
            meta(op="matmul"))


# ----------------------------------------------------------------------------------------------
# normalization


def batch_norm_case(name, training):
    seed_for(name)
    momentum, eps = 0.1, 1e-5
    x = leaf(randn(4, 3, 5, 5) * 1.5 + 0.5)
    weight, bias = leaf(randn(3)), leaf(randn(3))
    running_mean = randn(3)
    running_var = torch.rand(3) + 0.5
    rm, rv = running_mean.clone(), running_var.clone()
    y = F.batch_norm(x, rm, rv, weight, bias, training=training, momentum=momentum, eps=eps)
    dy = backward_with_dy(y)
    t = {"x": x, "weight": weight, "bias": bias, "y": y, "dy": dy, "grad.x": x.grad,
         "grad.weight": weight.grad, "grad.bias": bias.grad}
    if training:
        t.update({"running_mean_in": running_mean, "running_var_in": running_var,
                  "running_mean_out": rm, "running_var_out": rv})
    else:
        assert torch.equal(rm, running_mean) and torch.equal(rv, running_var)
        t.update({"running_mean": running_mean, "running_var": running_var})
    return t, meta(op="batch_norm", training=training, momentum=momentum, eps=eps)


@case
def batch_norm_train():
    return batch_norm_case("batch_norm_train", True)


@case
def batch_norm_eval():
    return batch_norm_case("batch_norm_eval", False)


def group_norm_case(name, groups):
    seed_for(name)
    eps = 1e-5
    x = leaf(randn(3, 6, 4, 4) * 2.0 - 0.3)
    weight, bias = leaf(randn(6)), leaf(randn(6))
    y = F.group_norm(x, groups, weight, bias, eps=eps)
    dy = backward_with_dy(y)
    return ({"x": x, "weight": weight, "bias": bias, "y": y, "dy": dy, "grad.x": x.grad,
             "grad.weight": weight.grad, "grad.bias": bias.grad},
            meta(op="group_norm", num_groups=groups, eps=eps))


@case
def group_norm():
    return group_norm_case("group_norm", 3)


@case
def group_norm_g1():
    return group_norm_case("group_norm_g1", 1)


# ----------------------------------------------------------------------------------------------
# elementwise


@case
def relu():
    seed_for("relu")
    x = randn(3, 4, 5)
    while bool((x.abs() < 1e-3).any()):  # keep away from the kink at 0
        x = randn(3, 4, 5)
    x = leaf(x)
    y = F.relu(x)
    dy = backward_with_dy(y)
    return {"x": x, "y": y, "dy": dy, "grad.x": x.grad}, meta(op="relu")


def binary_case(name, op):
    seed_for(name)
    a, b = leaf(randn(2, 3, 4)), leaf(randn(2, 3, 4))
    y = op(a, b)
    dy = backward_with_dy(y)
    return ({"a": a, "b": b, "y": y, "dy": dy, "grad.a": a.grad, "grad.b": b.grad},
            meta(op=name))


@case
def add():
    return binary_case("add", lambda a, b: a + b)


@case
def mul():
    return binary_case("mul", lambda a, b: a * b)


@case
def scale():
    seed_for("scale")
    alpha = 0.37
    x = leaf(randn(2, 3, 4))
    y = x * alpha
    dy = backward_with_dy(y)
    return {"x": x, "y": y, "dy": dy, "grad.x": x.grad}, meta(op="scale", alpha=alpha)


@case
def sigmoid():
    seed_for("sigmoid")
    x = randn(3, 4, 5) * 4
    x[0, 0, :4] = torch.tensor([30.0, -30.0, 90.0, -90.0])  # far out: no overflow, no NaN
    x = leaf(x)
    y = torch.sigmoid(x)
    dy = backward_with_dy(y)
    return {"x": x, "y": y, "dy": dy, "grad.x": x.grad}, meta(op="sigmoid")


def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC 2011), written here independently of tally's C++."""
    c, k0, k1 = list(counter), key & 0xFFFFFFFF, key >> 32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & 0xFFFFFFFF, p1 & 0xFFFFFFFF, ((p0 >> 32) ^ c[3] ^ k1) & 0xFFFFFFFF,
             p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


@case
def dropout():
    """tally's dropout: element e of sample s kept when Philox word e % 4 at counter (e / 4, first + s,
    step) under the layer's seed is >= p * 2^32; y = x * noise with noise = (float)(1 / (1 - p)) or 0,
    PyTorch's formula (F.dropout multiplies by a mask of those values; its own mask comes from its
    generator, so the mask here is tally's, drawn by this independent Philox)."""
    seed_for("dropout")
    p, seed, step, first = 0.3, 987654321012345, 7, 1000
    x = leaf(randn(2, 3, 4, 5))
    n, f = x.shape[0], x[0].numel()
    threshold = int(p * 4294967296.0 + 0.5)
    keep = torch.zeros(n, f, dtype=torch.bool)
    for s in range(n):
        sample = first + s
        for e in range(f):
            w = philox4x32_10([e >> 2, sample & 0xFFFFFFFF, step & 0xFFFFFFFF, step >> 32], seed)[e & 3]
            keep[s, e] = w >= threshold
    scale = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)
    noise = torch.where(keep, scale, torch.tensor(0.0)).reshape(x.shape)
    y = x * noise
    dy = backward_with_dy(y)
    return {"x": x, "y": y, "dy": dy, "grad.x": x.grad}, meta(op="dropout", p=p, seed=seed, step=step, first=first)


def scale_channels_case(name, s_shape):
    """Squeeze-and-excitation's channel scaling y = x * s, s (N, C, 1, 1) broadcast over H, W."""
    seed_for(name)
    x, s = leaf(randn(2, 3, 4, 5)), leaf(randn(*s_shape))
    y = x * s.reshape(2, 3, 1, 1)
    dy = backward_with_dy(y)
    return ({"x": x, "s": s, "y": y, "dy": dy, "grad.x": x.grad, "grad.s": s.grad},
            meta(op="scale_channels"))


@case
def scale_channels():
    return scale_channels_case("scale_channels", (2, 3, 1, 1))


@case
def scale_channels_2d():
    return scale_channels_case("scale_channels_2d", (2, 3))


@case
def concat():
    seed_for("concat")
    xs = [leaf(randn(2, c, 4, 3)) for c in (3, 1, 2)]
    y = torch.cat(xs, dim=1)
    dy = backward_with_dy(y)
    out = {"y": y, "dy": dy}
    for i, x in enumerate(xs):
        out["x%d" % i] = x
        out["grad.x%d" % i] = x.grad
    return out, meta(op="concat", dim=1)


# ----------------------------------------------------------------------------------------------
# pooling


def unary_case(name, shape, fn, **options):
    seed_for(name)
    x = leaf(randn(*shape))
    y = fn(x)
    dy = backward_with_dy(y)
    return {"x": x, "y": y, "dy": dy, "grad.x": x.grad}, meta(**options)


@case
def max_pool2d():
    return unary_case("max_pool2d", (2, 3, 7, 7),
                      lambda x: F.max_pool2d(x, kernel_size=3, stride=2, padding=1),
                      op="max_pool2d", kernel_size=3, stride=2, padding=1, dilation=1,
                      ceil_mode=False)


@case
def avg_pool2d():
    return unary_case("avg_pool2d", (2, 3, 6, 6),
                      lambda x: F.avg_pool2d(x, kernel_size=2, stride=2),
                      op="avg_pool2d", kernel_size=2, stride=2, padding=0, ceil_mode=False,
                      count_include_pad=True)


@case
def avg_pool2d_pad():
    return unary_case("avg_pool2d_pad", (2, 3, 7, 7),
                      lambda x: F.avg_pool2d(x, kernel_size=3, stride=2, padding=1,
                                             count_include_pad=True),
                      op="avg_pool2d", kernel_size=3, stride=2, padding=1, ceil_mode=False,
                      count_include_pad=True)


@case
def adaptive_avg_pool2d():
    return unary_case("adaptive_avg_pool2d", (2, 3, 7, 5),
                      lambda x: F.adaptive_avg_pool2d(x, (3, 2)),
                      op="adaptive_avg_pool2d", output_h=3, output_w=2)


@case
def global_avg_pool():
    return unary_case("global_avg_pool", (2, 4, 5, 5),
                      lambda x: F.adaptive_avg_pool2d(x, (1, 1)),
                      op="adaptive_avg_pool2d", output_h=1, output_w=1)


# ----------------------------------------------------------------------------------------------
# reductions and losses (scalar outputs: the upstream gradient is an implied 1.0)


def reduction_case(name, fn):
    seed_for(name)
    x = leaf(randn(3, 4))
    y = fn(x)
    assert y.dim() == 0
    y.backward()
    return {"x": x, "y": y, "grad.x": x.grad}, meta(op=name)


@case
def sum_():
    return reduction_case("sum", torch.sum)


@case
def mean_():
    return reduction_case("mean", torch.mean)


def cross_entropy_case(name, targets_fn=None, reduction="mean", ignore_index=-100,
                       label_smoothing=0.0, with_weight=False):
    seed_for(name)
    n, c = 6, 5
    logits = leaf(randn(n, c) * 2.0)
    targets = targets_fn() if targets_fn else torch.randint(0, c, (n,), dtype=torch.int64)
    weight = (torch.rand(c) + 0.5) if with_weight else None
    loss = F.cross_entropy(logits, targets, weight=weight, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    assert loss.dim() == 0
    loss.backward()
    t = {"logits": logits, "targets": targets, "loss": loss, "grad.logits": logits.grad}
    if with_weight:
        t["weight"] = weight
    return t, meta(op="cross_entropy", reduction=reduction, ignore_index=ignore_index,
                   label_smoothing=label_smoothing)


def targets_with(value, positions, n=6, c=5):
    """Random targets in [0, c) where exactly `positions` hold `value`."""
    t = torch.randint(0, c - 1, (n,), dtype=torch.int64)
    t[t >= value] += 1  # now never equal to value
    for p in positions:
        t[p] = value
    return t


@case
def cross_entropy_mean():
    return cross_entropy_case("cross_entropy_mean")


@case
def cross_entropy_sum():
    return cross_entropy_case("cross_entropy_sum", reduction="sum")


@case
def cross_entropy_smooth():
    return cross_entropy_case("cross_entropy_smooth", label_smoothing=0.1)


@case
def cross_entropy_ignore():
    return cross_entropy_case("cross_entropy_ignore", targets_fn=lambda: targets_with(2, (1, 4)),
                              ignore_index=2)


@case
def cross_entropy_weight():
    return cross_entropy_case("cross_entropy_weight", with_weight=True)


@case
def cross_entropy_all():
    return cross_entropy_case("cross_entropy_all", targets_fn=lambda: targets_with(1, (0, 3)),
                              ignore_index=1, label_smoothing=0.2, with_weight=True)


# ----------------------------------------------------------------------------------------------
# ResNet BasicBlock (torchvision layout and parameter names)


class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + identity
        return self.relu(out)


def basic_block_case(name, in_planes, planes, stride):
    seed_for(name)
    block = BasicBlock(in_planes, planes, stride).train()
    with torch.no_grad():
        for m in block.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.2)
    t = {}
    buffers_in = {k: v.detach().clone() for k, v in block.named_buffers()
                  if not k.endswith("num_batches_tracked")}
    x = leaf(randn(2, in_planes, 8, 8))
    for k, p in block.named_parameters():
        t[k] = p.detach().clone()
    y = block(x)
    dy = backward_with_dy(y)
    t.update({"x": x, "y": y, "dy": dy, "grad.x": x.grad})
    for k, p in block.named_parameters():
        t["grad." + k] = p.grad
    t.update(buffers_in)
    for k, v in block.named_buffers():
        if not k.endswith("num_batches_tracked"):
            t["out." + k] = v
    return t, meta(op="basic_block", in_planes=in_planes, planes=planes, stride=stride,
                   training=True, bn_momentum=0.1, bn_eps=1e-5)


@case
def basic_block():
    return basic_block_case("basic_block", 4, 4, 1)


@case
def basic_block_proj():
    return basic_block_case("basic_block_proj", 4, 8, 2)


# ----------------------------------------------------------------------------------------------


def build(name):
    tensors, metadata = CASES[name]()
    for k, v in tensors.items():
        if v is None:
            raise RuntimeError("%s: tensor %s is None (missing gradient?)" % (name, k))
        arr = _to_numpy(v)
        want = np.int64 if k == "targets" else np.float32
        if arr.dtype != want:
            raise RuntimeError("%s: tensor %s has dtype %s, expected %s" % (name, k, arr.dtype,
                                                                           np.dtype(want)))
        if arr.dtype == np.float32 and not np.isfinite(arr).all():
            raise RuntimeError("%s: tensor %s is not finite" % (name, k))
    metadata["case"] = name
    return serialize(tensors, metadata)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=FIXTURE_DIR, help="output directory")
    parser.add_argument("--check", action="store_true",
                        help="compare against the files in --out instead of writing")
    parser.add_argument("cases", nargs="*", help="cases to build (default: all)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    names = args.cases or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error("unknown case(s): %s" % ", ".join(unknown))
    os.makedirs(args.out, exist_ok=True)

    total, bad = 0, 0
    for name in names:
        payload = build(name)
        total += len(payload)
        bad += emit(os.path.join(args.out, name + ".safetensors"), payload, args.check, MAX_FILE_BYTES)
    if total > MAX_TOTAL_BYTES:
        raise RuntimeError("fixtures total %d bytes, over the %d byte limit" % (total,
                                                                              MAX_TOTAL_BYTES))
    print("%d case(s), %d bytes in all%s" % (len(names), total,
                                            (", %d differ" % bad) if args.check else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
