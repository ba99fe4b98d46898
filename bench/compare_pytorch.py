#!/usr/bin/env python3
"""bench/compare_pytorch.py — tally and PyTorch side by side: the same model, batch, precision
and device, training steps in one run, images/s and peak memory of both and their ratio.

    python3 bench/compare_pytorch.py --model resnet20 --batch 128 --steps 20 --device cpu
    python3 bench/compare_pytorch.py --model resnet50 --batch 256 --device cuda [--tf32]
    python3 bench/compare_pytorch.py --model resnet50 --batch 16 --precision bf16 --threads 2

PyTorch side: SGD (momentum 0.9, weight decay 5e-4) training steps on random data of the input
shape, each step's batch copied from pinned host memory, eager mode, float32, TF32 off unless
--tf32 (then on for matmuls and cuDNN), cuDNN's benchmark mode off as by default (--cudnn-benchmark:
on; it then times the algorithms and may pick non-deterministic ones, where tally picks
deterministic ones by heuristics); the first --warmup steps are not timed.
tally side: `tally train --data synthetic` for 3x32x32 models, `--data synthetic:3x224x224
--num-classes 1000` for ImageNet-sized ones (same model, batch, optimizer, float32, --tf32 passed
on), whose images/s leaves out the first step; its peak is the arena's measured step peak. On CUDA
PyTorch's peak is torch.cuda.max_memory_allocated() for the timed steps. On the CPU PyTorch has
no allocator statistics, so its column is the growth of the process's maximum resident set
during training (an upper bound that includes allocator caching), and the ratio is omitted.
--precision bf16: tally trains with `--precision bf16` (bf16 activations, float32 master weights);
PyTorch runs the forward under torch.autocast(device, torch.bfloat16) with the loss in float32 — the
mode a PyTorch user picks — and on CUDA also in channels_last (the memory format its bf16
convolutions want; tally's CUDA activations stay NCHW).
--tally-conv-api legacy,graph: the tally side once per cuDNN convolution API
(TALLY_CUDNN_CONV_API, docs/gpu.md), a row each, against the one PyTorch run.
--tally-deterministic on,off: the same for tally's `--deterministic` (CUDA; PyTorch's defaults allow
cuDNN's nondeterministic algorithms); --tally-memory-format contiguous,channels_last: for tally's
`--memory-format`; with several lists, a row per combination.
--torch-profile FILE: no timing and no tally side; PyTorch's profiler over --steps steps after the
warm-up, its table of ops by GPU time (CPU time on the CPU) written to FILE and printed — the
PyTorch half of the GPU check's profile step, beside `tally train --profile`.
ResNet-20 comes from tests/gen_model_fixtures.py (the same definition the fixtures use);
ResNet-18/50 from torchvision.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def make_model(name, classes):
    if name.startswith("resnet") and name[6:].isdigit() and int(name[6:]) in (20, 32, 44, 56, 110):
        from gen_model_fixtures import CifarResNet
        return CifarResNet(int(name[6:]), classes)
    import torchvision
    return getattr(torchvision.models, name)(num_classes=classes)


def torch_side(args, hw, classes):
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.manual_seed(0)
    model = make_model(args.model, classes).to(dev).train()
    bf16 = args.precision == "bf16"
    channels_last = (bf16 and dev.type == "cuda") or args.torch_channels_last
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    # Each step takes its batch from host memory, as a training loop does (tally's steps upload
    # theirs too): pinned, copied without blocking, as DataLoader(pin_memory=True) would give it.
    pin = dev.type == "cuda"
    x_host = torch.randn(args.batch, 3, hw, hw, pin_memory=pin)
    y_host = torch.randint(0, classes, (args.batch,), pin_memory=pin)

    def step():
        x = x_host.to(dev, non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = y_host.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=False)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        loss.backward()
        opt.step()

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for _ in range(args.warmup):
        step()
    if args.torch_profile:
        return profile_steps(args, dev, step)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if dev.type == "cuda":
        peak, peak_kind = torch.cuda.max_memory_allocated(), "max_memory_allocated"
    else:
        peak, peak_kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0, "max RSS growth"
    return args.batch * args.steps / dt, peak, peak_kind


def profile_steps(args, dev, step):
    """--torch-profile: args.steps steps under torch.profiler; the table of ops by (self) GPU time."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    avg = prof.key_averages()
    table = None
    # The sort key's name changed across PyTorch versions (cuda_* before 2.4, device_* since).
    keys = ["self_device_time_total", "self_cuda_time_total"] if dev.type == "cuda" else ["self_cpu_time_total"]
    for key in keys:
        try:
            table = avg.table(sort_by=key, row_limit=40, max_name_column_width=60)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    if table is None:
        table = avg.table(row_limit=40)
    head = (f"PyTorch {torch.__version__} profile: {args.model} batch {args.batch}, precision {args.precision}"
            f"{' (TF32 on)' if args.tf32 else ''}{', cudnn.benchmark on' if args.cudnn_benchmark else ''}, "
            f"{args.steps} steps after {args.warmup} warm-up\n")
    with open(args.torch_profile, "w") as f:
        f.write(head + table + "\n")
    print(head + table)
    return None


def tally_side(args, hw, classes, conv_api=None, deterministic=None, memory_format=None):
    data = "synthetic" if hw == 32 else f"synthetic:3x{hw}x{hw}"
    with tempfile.TemporaryDirectory() as out:
        cmd = [args.tally, "train", "--model", args.model, "--data", data, "--num-classes", str(classes),
               "--batch-size", str(args.batch), "--steps", str(args.steps + 1), "--lr", "0.01", "--schedule",
               "constant", "--no-augment", "--device", args.device, "--out", out, "--no-progress",
               "--precision", args.precision]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.tf32:
            cmd += ["--tf32"]
        if deterministic:
            cmd += ["--deterministic", deterministic]
        if memory_format:
            cmd += ["--memory-format", memory_format]
        if args.tally_tuning_seconds is not None:
            cmd += ["--tuning-seconds", str(args.tally_tuning_seconds)]
        env = dict(os.environ)
        if conv_api:
            env["TALLY_CUDNN_CONV_API"] = conv_api
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
    return s["images_per_second"], s["peak_bytes"], s["micro_batches_per_step"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet20")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tf32", action="store_true", help="allow TF32 on both sides (CUDA)")
    p.add_argument("--cudnn-benchmark", action="store_true", help="PyTorch: torch.backends.cudnn.benchmark = True")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: tally --precision bf16 against PyTorch bf16 autocast (+ channels_last on CUDA)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for both (0: all cores)")
    p.add_argument("--tally", default=os.path.join(ROOT, "build", "apps", "tally"))
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate the two sides this many times (the machine's speed drifts: compare within a "
                        "round) and print each round and the median ratio")
    p.add_argument("--torch-channels-last", action="store_true",
                   help="PyTorch in channels_last on the CPU too (its default there is NCHW)")
    p.add_argument("--tally-conv-api", default="",
                   help="comma-separated cuDNN convolution APIs (legacy, graph): the tally side once per API, a row each")
    p.add_argument("--tally-memory-format", default="",
                   help="comma-separated contiguous/channels_last: tally's --memory-format, a row each")
    p.add_argument("--tally-deterministic", default="",
                   help="comma-separated on/off: tally's --deterministic, the tally side once per value, a row each")
    p.add_argument("--tally-tuning-seconds", type=float, default=None, metavar="S",
                   help="tally's --tuning-seconds (CUDA: the most time it measures convolution engines; "
                        "its first step, which is not timed)")
    p.add_argument("--torch-profile", default="", metavar="FILE",
                   help="profile --steps PyTorch steps (no timing, no tally side) and write the op table to FILE")
    args = p.parse_args()
    apis = [a for a in args.tally_conv_api.split(",") if a] or [None]
    for a in apis:
        if a not in (None, "legacy", "graph"):
            p.error(f"--tally-conv-api: expected legacy and/or graph, got '{a}'")
    dets = [d for d in args.tally_deterministic.split(",") if d] or [None]
    for d in dets:
        if d not in (None, "on", "off"):
            p.error(f"--tally-deterministic: expected on and/or off, got '{d}'")
    fmts = [f for f in args.tally_memory_format.split(",") if f] or [None]
    for f in fmts:
        if f not in (None, "contiguous", "channels_last"):
            p.error(f"--tally-memory-format: expected contiguous and/or channels_last, got '{f}'")
    # The tally rows: one per (API, determinism, memory format), named by what was given.
    variants = [(a, d, f, "-".join([x for x in (a, d and f"det-{d}", f and {"contiguous": "nchw",
                                                                            "channels_last": "nhwc"}[f]) if x]))
                for a in apis for d in dets for f in fmts]
    if args.threads:
        torch.set_num_threads(args.threads)
    hw = 32 if args.model in ("resnet20", "resnet32", "resnet44", "resnet56", "resnet110") else 224
    classes = 10 if hw == 32 else 1000
    if args.torch_profile:
        torch_side(args, hw, classes)
        return
    # A tally side that fails is a row saying so (and a non-zero exit at the end), not the loss of
    # the other rows: on an H100 the graph API's failure once took the legacy and PyTorch numbers with it.
    failed = []

    def one_tally(a, d, f, label):
        try:
            return (label, *tally_side(args, hw, classes, a, d, f))
        except subprocess.CalledProcessError as e:
            failed.append(label or "tally")
            return (label, None, None, f"exit {e.returncode}")

    rounds = []
    for _ in range(max(args.rounds, 1)):
        tallies = [one_tally(*v) for v in variants]
        p_ips, p_peak, p_kind = torch_side(args, hw, classes)
        if tallies[0][1] is not None:
            rounds.append((tallies[0][1], p_ips))
    mib = 1 << 20
    prec = "bf16 (PyTorch: autocast" + (" + channels_last)" if args.device != "cpu" else ")") if args.precision == "bf16" else "float32"
    if args.torch_channels_last and args.device == "cpu":
        prec += ", PyTorch channels_last"
    print(f"{args.model} batch {args.batch}, {prec}{' (TF32 on)' if args.tf32 else ''}, {args.device}, {args.steps} timed steps, "
          f"{'cudnn.benchmark on, ' if args.cudnn_benchmark else ''}"
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"{'':18} {'images/s':>10} {'peak MiB':>10}")
    for a, t_ips, t_peak, k in tallies:
        name = f"tally-{a}" if a else "tally"
        if t_ips is None:
            print(f"{name:18} {'failed':>10} {'':>10}   ({k}; its error is above)")
            continue
        print(f"{name:18} {t_ips:10.1f} {t_peak / mib:10.1f}   (arena step peak; {k} micro-batch(es))")
    print(f"{'pytorch':18} {p_ips:10.1f} {p_peak / mib:10.1f}   ({p_kind})")
    for a, t_ips, t_peak, k in tallies:
        if t_ips is None:
            continue
        ratio_mem = f"{t_peak / p_peak:.2f}" if args.device != "cpu" and p_peak > 0 else "n/a"
        name = f"ratio-{a}" if a else "ratio"
        print(f"{name:18} {t_ips / p_ips:10.2f} {ratio_mem:>10}   (tally / pytorch)")
    if len(rounds) > 1:
        ratios = sorted(t / q for t, q in rounds)
        print("rounds (tally, pytorch images/s, ratio): " +
              "; ".join(f"{t:.1f}, {q:.1f}, {t / q:.2f}" for t, q in rounds))
        print(f"median ratio {ratios[len(ratios) // 2]:.2f} over {len(rounds)} rounds")
    if failed:
        sys.exit(f"compare_pytorch: the tally side failed for {', '.join(failed)}")


if __name__ == "__main__":
    main()
