#!/usr/bin/env python3
"""fuzz/make_seeds.py — writes the seed inputs of fuzz/corpus/<name>/ (safetensors, idx, cifar, cli, checkpoint).

Small valid files of each format and a few broken ones, each named for what it is. Run it from
anywhere; it (re)writes only the files it names, so regression inputs of past findings kept in
the same folders stay. Input layouts per harness: see the opening comment of fuzz/fuzz_<name>.cpp.
"""
import gzip
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(harness, name, data):
    d = os.path.join(HERE, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def safetensors(tensors, metadata=None, pad=True):
    """tensors: name -> (dtype, shape, raw bytes); laid out in name order, as tally writes."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def safetensors_seeds():
    f32 = struct.pack("<4f", 1.0, -2.0, 0.5, 3.25)
    put("safetensors", "valid_f32_2x2", safetensors({"w": ("F32", [2, 2], f32)}, {"format": "pt"}))
    put("safetensors", "valid_mixed_dtypes", safetensors({
        "a.bias": ("F64", [2], struct.pack("<2d", 0.25, -1.0)),
        "b.steps": ("I64", [], struct.pack("<q", 7)),
        "c.half": ("BF16", [3], struct.pack("<3H", 0x3f80, 0xc000, 0x0000)),
        "d.mask": ("BOOL", [2], b"\x01\x00"),
        "e.empty": ("F32", [0, 3], b""),
    }))
    good = safetensors({"w": ("F32", [2, 2], f32)})
    put("safetensors", "broken_truncated_data", good[:-3])
    put("safetensors", "broken_header_length_huge", struct.pack("<Q", 1 << 62) + good[8:])
    put("safetensors", "broken_header_not_json", struct.pack("<Q", 8) + b"{\"w\":[1,")
    put("safetensors", "broken_unknown_dtype", safetensors({"w": ("F31", [4], f32)}))
    put("safetensors", "broken_shape_disagrees", safetensors({"w": ("F32", [3, 2], f32)}))
    h = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
    put("safetensors", "broken_overlapping_offsets", struct.pack("<Q", len(h)) + h + bytes(12))


def idx_images(count, rows, cols, pixels=None):
    pixels = pixels if pixels is not None else bytes((i * 37) % 256 for i in range(count * rows * cols))
    return struct.pack(">iiii", 0x803, count, rows, cols) + pixels


def idx_labels(labels):
    return struct.pack(">ii", 0x801, len(labels)) + bytes(labels)


def idx_seeds():
    img, lab = idx_images(3, 4, 4), idx_labels([0, 9, 4])
    put("idx", "valid_images_3x4x4", img)
    put("idx", "valid_labels_3", lab)
    put("idx", "valid_pair_images_then_labels", img + lab)
    put("idx", "valid_pair.gz", gzip.compress(img + lab, mtime=0))
    put("idx", "valid_images.gz", gzip.compress(img, mtime=0))
    put("idx", "valid_two_gzip_members.gz", gzip.compress(img, mtime=0) + gzip.compress(lab, mtime=0))
    put("idx", "broken_pair_label_out_of_range", img + idx_labels([0, 10, 4]))
    put("idx", "broken_pair_counts_differ", img + idx_labels([1, 2]))
    put("idx", "broken_images_truncated", img[:-5])
    put("idx", "broken_images_huge_count", struct.pack(">iiii", 0x803, 60000, 4096, 4096) + bytes(16))
    put("idx", "broken_labels_trailing_bytes", lab + b"\x00\x00")
    put("idx", "broken_gzip_truncated.gz", gzip.compress(img, mtime=0)[:-6])
    z = bytearray(gzip.compress(img, mtime=0))
    z[-8] ^= 0xff  # CRC of the trailer
    put("idx", "broken_gzip_bad_crc.gz", bytes(z))
    put("idx", "broken_gzip_inside_gzip.gz", gzip.compress(gzip.compress(img, mtime=0), mtime=0))


def cifar_seeds():
    pixels = bytes((i * 13) % 256 for i in range(3072))
    put("cifar", "valid_cifar10_two_records", b"\x00" + b"\x03" + pixels + b"\x09" + pixels)
    put("cifar", "valid_cifar100_one_record", b"\x01" + b"\x13\x63" + pixels)
    put("cifar", "broken_cifar10_partial_record", b"\x00" + b"\x03" + pixels + b"\x01" + pixels[:100])
    put("cifar", "broken_cifar10_label_10", b"\x00" + b"\x0a" + pixels)
    put("cifar", "broken_cifar100_coarse_20", b"\x01" + b"\x14\x05" + pixels)
    put("cifar", "broken_empty", b"\x00")


def cli_seeds():
    # First byte: 0 parse_size, 1 parse_device, 2 parse_positive_integer, 3 parse_micro_batch,
    # 4 parse_memory_limit (comma list per rank), 5 parse_batch_sizes, 6 parse_checkpoint_every,
    # 7 parse_pipeline_split (ResNet-20's segments).
    seeds = {
        "size_512MiB": "\x00512MiB", "size_1.5_GiB": "\x001.5 GiB", "size_2e3": "\x002e3", "size_bad_unit": "\x0012XB",
        "device_cpu": "\x01cpu", "device_cuda0": "\x01cuda:0", "device_cuda_bad": "\x01cuda:x1",
        "int_128": "\x02128", "int_huge": "\x0299999999999999999999", "int_zero": "\x020",
        "micro_auto": "\x03auto", "micro_64": "\x0364", "micro_neg": "\x03-4",
        "memory_auto": "\x04auto", "memory_per_rank": "\x0448MiB,24MiB", "memory_empty_item": "\x0448MiB,,1GiB",
        "memory_below_granularity": "\x041B",
        "batches_list": "\x0564,128,256", "batches_twice": "\x0564,64", "batches_trailing_comma": "\x0564,",
        "every_500": "\x06500", "every_90s": "\x0690s", "every_1.5h": "\x061.5h", "every_bad_unit": "\x0610x",
        "split_layer2.1": "\x07layer2.1", "split_two": "\x07layer2.0,layer3.0", "split_backwards": "\x07layer3.0,layer2.0",
        "split_unknown": "\x07layer9.0", "split_stem": "\x07stem", "split_empty_item": "\x07layer2.0,,layer3.0",
    }
    for name, text in seeds.items():
        put("cli", name, text)


def checkpoint_seeds():
    # The manifest's text, a NUL, then state.safetensors; "@bytes" and "@crc" are filled in by the
    # harness with the tensor part's size and CRC-32 (fuzz/fuzz_checkpoint.cpp).
    tensors = safetensors({"model.fc.weight": ("F32", [2, 2], struct.pack("<4f", 1.0, -2.0, 0.5, 3.25)),
                           "model.bn.num_batches_tracked": ("I64", [], struct.pack("<q", 7)),
                           "optimizer.momentum_buffer.0": ("F32", [2, 2], struct.pack("<4f", 0.1, 0.2, 0.3, 0.4))})
    metrics = b"step,loss\n1,2.302585\n"
    import zlib
    def manifest(**over):
        m = {"format": "tally-training-state", "version": 1, "step": 5,
             "optimizer": {"name": "SGD", "steps": 5},
             "files": {"state.safetensors": {"bytes": "@bytes", "crc32": "@crc"},
                       "metrics.csv": {"bytes": len(metrics), "crc32": zlib.crc32(metrics)}},
             "state": {"options": {"model": "resnet20"}, "world_size": 1, "micro_batch_limits": [0]}}
        m.update(over)
        return json.dumps(m, indent=1)
    put("checkpoint", "valid", manifest() + "\0" + tensors.decode("latin-1"))
    put("checkpoint", "valid_crc_written_out",
        manifest(files={"state.safetensors": {"bytes": len(tensors), "crc32": zlib.crc32(tensors)},
                        "metrics.csv": {"bytes": len(metrics), "crc32": zlib.crc32(metrics)}}).encode()
        + b"\0" + tensors)
    put("checkpoint", "broken_wrong_crc", manifest(files={"state.safetensors": {"bytes": len(tensors), "crc32": 1}})
        + "\0" + tensors.decode("latin-1"))
    put("checkpoint", "broken_no_tensors", manifest())
    put("checkpoint", "broken_missing_file", manifest(files={"state.safetensors": {"bytes": "@bytes", "crc32": "@crc"},
                                                             "other.txt": {"bytes": 1, "crc32": 0}})
        + "\0" + tensors.decode("latin-1"))
    put("checkpoint", "broken_version_2", manifest(version=2) + "\0" + tensors.decode("latin-1"))
    put("checkpoint", "broken_truncated_json", manifest()[:60])


if __name__ == "__main__":
    safetensors_seeds()
    idx_seeds()
    cifar_seeds()
    cli_seeds()
    checkpoint_seeds()
