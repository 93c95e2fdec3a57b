#!/usr/bin/env python3
"""Writes a GGUF file of a Qwen3, Llama, LFM2 or Qwen3.5 (dense) checkpoint for llama.cpp, for the side by side.

llama.cpp's own converter (convert_hf_to_gguf.py) needs transformers and a recent torch, which this project's
machines do not have; this one needs numpy and the `gguf` package of the llama.cpp snapshot being measured
(--gguf-py LLAMA_SRC/gguf-py: its writer, tensor-name map and constants, so the file is what that snapshot
reads). It reads config.json, model.safetensors (one file or a sharded index) and tokenizer.json (byte-level
BPE, as Qwen3's and Llama 3's), and writes the weights in --outtype: bf16 (the checkpoint's bits when it is
bf16), f16 or f32. Quantize the result with llama.cpp's llama-quantize for Q8_0.

What it writes follows the GGUF format and llama.cpp's published conventions: the hyperparameters under
"<arch>.", the tokenizer as "gpt2" (byte-level BPE) with its pre-tokenizer name, for Llama the q / k rows
reordered from transformers' half-split RoPE to llama.cpp's interleaved one, for LFM2 the key-value head count
per layer (0 for a conv layer) and the conv weights [C, 1, K] as [C, K]; for Qwen3.5 what llama.cpp's
qwen35 graph takes: A as -exp(A_log), dt_bias as the dt projection's bias, the norms' (1 + w) folded into w
(not the gated norm's), the conv taps [C, K], V heads reordered from grouped-by-K-head to tiled order
(qkv rows, z rows, a / b rows, A, dt, conv channels, out_proj columns), the Gated DeltaNet sizes, and the
interleaved MRoPE sections of text-only positions.
"""

import argparse
import json
import os
import struct
import sys

import numpy as np

# config.json's model_type (transformers' name, what `rewind init-random` writes) -> (gguf arch, pre-tokenizer).
SUPPORTED = {"qwen3": ("QWEN3", "qwen2"), "llama": ("LLAMA", "llama-bpe"), "lfm2": ("LFM2", "lfm2"),
             "qwen3_5": ("QWEN35", "qwen35")}


def read_safetensors(path):
    """name -> (dtype string, shape, raw bytes as a numpy uint8 view) of one .safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[begin:end])
    return out


def load_tensors(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(model_dir, name)))
    return tensors


def f32_as(f32, outtype):
    """An f32 array in `outtype`: bf16 as uint16 bit patterns (round to nearest even), f16 / f32 as floats."""
    if outtype == "f32":
        return np.ascontiguousarray(f32, dtype=np.float32)
    if outtype == "f16":
        return f32.astype(np.float16)
    u = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def as_array(dtype, shape, raw, outtype):
    """The tensor in `outtype`: bf16 as uint16 bit patterns, f16 / f32 as numpy floats."""
    if dtype == "BF16":
        bits = raw.view(np.uint16).reshape(shape)
        if outtype == "bf16":
            return bits
        f32 = (bits.astype(np.uint32) << 16).view(np.float32)
    elif dtype == "F16":
        f32 = raw.view(np.float16).reshape(shape).astype(np.float32)
    elif dtype == "F32":
        f32 = raw.view(np.float32).reshape(shape)
    else:
        sys.exit(f"to_gguf: tensor dtype {dtype} is not supported (BF16, F16, F32)")
    return f32_as(f32, outtype)


def tiled_v_heads(a, axis, k_heads, v_per_k, head_dim):
    """V heads stored grouped by K head ([G0 v0..v(r-1), G1 ...]) in tiled order ([G0 v0, G1 v0, ..., G0 v1, ...]),
    along `axis`."""
    shape = list(a.shape)
    a = a.reshape(shape[:axis] + [k_heads, v_per_k, head_dim] + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(a, axis, axis + 1)).reshape(shape)


def qwen35_tensor(name, a, cfg):
    """(GGUF-side HF name, f32 array) of a Qwen3.5 text tensor, as llama.cpp's qwen35 graph takes it."""
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = vh // kh
    if name.endswith(".A_log"):
        a = -np.exp(a)
    elif name.endswith(".dt_bias"):
        name = name[: -len(".dt_bias")] + ".dt_proj.bias"
    elif name.endswith("conv1d.weight"):
        a = a.reshape(a.shape[0], a.shape[-1])
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        a = a + 1.0
    if r > 1 and ".linear_attn." in name:
        if ".in_proj_qkv." in name:
            qk = 2 * kh * kd
            a = np.concatenate([a[:qk], tiled_v_heads(a[qk:], 0, kh, r, vd)], axis=0)
        elif ".in_proj_z." in name:
            a = tiled_v_heads(a, 0, kh, r, vd)
        elif ".in_proj_a." in name or ".in_proj_b." in name:
            a = tiled_v_heads(a, 0, kh, r, 1)
        elif name.endswith((".A_log", ".dt_proj.bias")):
            a = tiled_v_heads(a.reshape(-1, 1), 0, kh, r, 1).reshape(-1)
        elif "conv1d" in name:
            qk = 2 * kh * kd
            a = np.concatenate([a[:qk], tiled_v_heads(a[qk:], 0, kh, r, vd)], axis=0)
        elif ".out_proj." in name:
            a = tiled_v_heads(a, 1, kh, r, vd)
    return name, a


def interleave_rope_rows(w, heads):
    """transformers' q / k rows (each head's rotated halves apart) in llama.cpp's order (pairs adjacent)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab(tokenizer_path, vocab_size):
    """(tokens, token types, merges, whether BOS is added) of a byte-level BPE tokenizer.json, padded to
    vocab_size. BOS is added when its post-processor names a special token (Llama 3's TemplateProcessing)."""
    import gguf

    with open(tokenizer_path, encoding="utf-8") as f:
        tok = json.load(f)
    model = tok["model"]
    if model.get("type") != "BPE":
        sys.exit(f"to_gguf: {tokenizer_path}: model type {model.get('type')}, only byte-level BPE is supported")
    by_id = {i: t for t, i in model["vocab"].items()}
    special = {}
    for added in tok.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        special[added["id"]] = added.get("special", False)
    size = max(vocab_size, max(by_id) + 1)
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in special:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if special[i] else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    post = json.dumps(tok.get("post_processor"))
    adds_bos = any(special[i] and json.dumps(by_id[i]) in post for i in special)
    return tokens, types, merges, adds_bos


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--outtype", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--gguf-py", required=True, help="the llama.cpp snapshot's gguf-py directory")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the one in model_dir)")
    ap.add_argument("--pre", help="llama.cpp's pre-tokenizer name (default: the family's; gpt-2 for a plain "
                    "ByteLevel tokenizer)")
    args = ap.parse_args()
    sys.path.insert(0, args.gguf_py)
    import gguf

    with open(os.path.join(args.model_dir, "config.json")) as f:
        cfg = json.load(f)
    kind = cfg.get("model_type")
    if "text_config" in cfg:  # Qwen3.5: the language model's fields
        cfg = dict(cfg["text_config"], tie_word_embeddings=cfg.get("tie_word_embeddings",
                                                                   cfg["text_config"].get("tie_word_embeddings")))
    if kind not in SUPPORTED:
        sys.exit(f"to_gguf: model_type {kind!r} is not supported (supported: {', '.join(sorted(SUPPORTED))})")
    arch_name, pre = SUPPORTED[kind]
    pre = args.pre or pre
    # transformers 5 keeps RoPE under rope_parameters, 4.x under rope_theta / rope_scaling.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    arch = getattr(gguf.MODEL_ARCH, arch_name)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers = cfg["num_hidden_layers"]

    w = gguf.GGUFWriter(args.out, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(os.path.basename(os.path.normpath(args.model_dir)))
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    if arch_name == "LFM2":
        w.add_head_count_kv([kv_heads if t != "conv" else 0 for t in cfg["layer_types"]])
        w.add_shortconv_l_cache(cfg["conv_L_cache"])
        w.add_vocab_size(cfg["vocab_size"])
    else:
        w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", cfg.get("norm_eps", 1e-6)))
    w.add_file_type({"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "f32": gguf.LlamaFileType.ALL_F32}[args.outtype])
    if rope.get("rope_type", rope.get("type")) not in (None, "default"):
        sys.exit(f"to_gguf: RoPE {rope} is not supported here (plain RoPE only)")
    rope_dim = head_dim
    if arch_name == "QWEN35":
        rope_dim = int(head_dim * rope.get("partial_rotary_factor", 0.25))
        types = cfg["layer_types"]
        interval = types.index("full_attention") + 1
        if any((t == "full_attention") != ((i + 1) % interval == 0) for i, t in enumerate(types)):
            sys.exit(f"to_gguf: layer_types {types} are not every {interval}th layer full attention, which "
                     "llama.cpp's qwen35 reads from one interval")
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(interval)
        # Text positions are the same in every MRoPE section, so the sections only have to cover the pairs.
        pairs = rope_dim // 2
        w.add_rope_dimension_sections([pairs - 2 * (pairs // 3), pairs // 3, pairs // 3, 0])
    w.add_rope_dimension_count(rope_dim)

    tokens, types, merges, adds_bos = byte_level_vocab(args.tokenizer or os.path.join(args.model_dir, "tokenizer.json"),
                                             cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    eos = cfg.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_add_bos_token(adds_bos)

    names = gguf.get_tensor_name_map(arch, layers)
    tensors = load_tensors(args.model_dir)
    tied = "lm_head.weight" not in tensors
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        qwen35 = None
        if arch_name == "QWEN35":
            if not name.startswith(("model.language_model.", "lm_head.")):
                continue  # vision tower, multi-token-prediction head: not the text model
            hf = name.replace("model.language_model.", "model.")
            hf, qwen35 = qwen35_tensor(hf, as_array(dtype, shape, raw, "f32"), cfg)
            name, shape = hf, list(qwen35.shape)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            sys.exit(f"to_gguf: no GGUF name for tensor {name}")
        # Norm weights, 1-D tensors and the short-conv taps in f32, as llama.cpp's converter keeps them (its CPU
        # kernels for those take f32 only).
        f32 = (len(shape) <= 1 or gguf_name.endswith("_norm.weight") or ".shortconv.conv." in gguf_name
               or ".ssm_conv1d." in gguf_name or gguf_name.endswith((".ssm_a", ".ssm_norm.weight")))
        out = "f32" if f32 else args.outtype
        a = as_array(dtype, shape, raw, out) if qwen35 is None else f32_as(qwen35, out)
        if arch_name == "LFM2" and name.endswith("conv.conv.weight"):
            a = a.reshape(shape[0], shape[-1])
        if arch_name == "LLAMA" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            a = interleave_rope_rows(a, heads if "q_proj" in name else kv_heads)
        raw_dtype = gguf.GGMLQuantizationType.BF16 if out == "bf16" else None
        w.add_tensor(gguf_name, np.ascontiguousarray(a), raw_dtype=raw_dtype)
    if tied:
        print("to_gguf: tied embedding (no lm_head.weight): llama.cpp uses token_embd for the output", file=sys.stderr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"to_gguf: wrote {args.out} ({len(tensors)} tensors, {args.outtype})", file=sys.stderr)


if __name__ == "__main__":
    main()
