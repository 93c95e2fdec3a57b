"""Export / import of the rewind model format (docs/model-format.md):
DIR/config.json + DIR/model.safetensors, with a small safetensors writer
and reader of our own (no safetensors package needed).

safetensors layout: 8-byte little-endian header length N, N bytes of JSON
header (padded with spaces to a multiple of 8 so the data starts aligned),
then the tensors' bytes, row-major little-endian, back to back.

  /usr/bin/python3 scripts/train/export.py CHECKPOINT.pt OUT_DIR [--dtype f16|bf16|f32]
"""
import argparse
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import Config, Model  # noqa: E402

DTYPES = {"f32": (torch.float32, "F32", "float32"),
          "f16": (torch.float16, "F16", "float16"),
          "bf16": (torch.bfloat16, "BF16", "bfloat16")}
TORCH_OF = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def tensor_bytes(t):
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret as int16
        return t.view(torch.int16).numpy().astype("<i2").tobytes()
    return t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()


def write_safetensors(path, tensors, metadata=None):
    """tensors: dict name -> torch tensor (F32/F16/BF16), written in the
    order given. Writes a temp file and renames it over `path`."""
    header, blobs, offset = {}, [], 0
    code = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    for name, t in tensors.items():
        data = tensor_bytes(t)
        header[name] = {"dtype": code[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-len(text)) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_safetensors(path):
    """name -> torch tensor in its stored dtype."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        dt = TORCH_OF[e["dtype"]]
        np_dt = {"F32": "<f4", "F16": "<f2", "BF16": "<i2"}[e["dtype"]]
        arr = np.frombuffer(data[b:end], dtype=np_dt).copy()
        t = torch.from_numpy(arr)
        if dt == torch.bfloat16:
            t = t.view(torch.bfloat16)
        out[name] = t.reshape(e["shape"])
    return out


def export_model(model: Model, out_dir, dtype="f16", metadata=None):
    torch_dtype, _, cfg_name = DTYPES[dtype]
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = cfg_name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    tensors = {k: v.to(torch_dtype) for k, v in model.state_dict().items()}
    meta = {"format": "pt", "generator": "rewind scripts/train/export.py"}
    meta.update(metadata or {})
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, meta)


def load_model(model_dir):
    """The model of DIR in f32 (weights as stored, converted exactly)."""
    cfg = Config.load(os.path.join(model_dir, "config.json"))
    model = Model(cfg)
    tensors = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    model.eval()
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="f16", choices=sorted(DTYPES))
    args = ap.parse_args()
    ck = torch.load(args.checkpoint, map_location="cpu")
    model = Model(Config.from_dict(ck["config"]))
    model.load_state_dict(ck["model"])
    export_model(model, args.out_dir, args.dtype)
    print(f"wrote {args.out_dir}/config.json and {args.out_dir}/model.safetensors ({args.dtype})")


if __name__ == "__main__":
    main()
