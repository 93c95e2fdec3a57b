"""Quick checks of the training code (no data needed, a few seconds):

  /usr/bin/python3 scripts/train/selftest.py

- the chunked Gated DeltaNet equals the per-token recurrence, also across
  chunk boundaries and with padding;
- a whole model gives the same logits with either form;
- the safetensors writer: header length field, header padded with spaces to
  a multiple of 8, contiguous data, exact round trip in F32, F16 and BF16.
"""
import json
import os
import struct
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export import export_model, load_model, read_safetensors, write_safetensors  # noqa: E402
from model import Config, Model, chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule  # noqa: E402


def check_delta_rule():
    torch.manual_seed(0)
    for T in (1, 63, 64, 150):
        B, H, Dk, Dv = 2, 3, 16, 8
        q = l2norm(torch.randn(B, T, H, Dk)) / 4
        k = l2norm(torch.randn(B, T, H, Dk))
        v = torch.randn(B, T, H, Dv)
        g = -torch.rand(B, T, H) * 3
        beta = torch.rand(B, T, H)
        diff = (recurrent_gated_delta_rule(q, k, v, g, beta) - chunk_gated_delta_rule(q, k, v, g, beta)).abs().max()
        assert diff < 1e-5, (T, diff)
    print("delta rule: chunked == recurrent")


def tiny_config():
    return Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=64, layer_types=["linear_attention", "sliding_attention", "conv", "full_attention"],
                  sliding_window=5, linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, conv_L_cache=3)


def check_model():
    torch.manual_seed(1)
    m = Model(tiny_config())
    x = torch.randint(0, 258, (2, 100))
    with torch.no_grad():
        diff = (m(x) - m(x, recurrent=True)).abs().max()
    assert diff < 1e-5, diff
    print("model: chunked == recurrent")


def check_safetensors():
    torch.manual_seed(2)
    tensors = {"a": torch.randn(3, 5), "b.h": torch.randn(7).half(), "c": torch.randn(2, 2, 3).bfloat16(),
               "empty": torch.zeros(0, 4)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.safetensors")
        write_safetensors(path, tensors, {"format": "pt"})
        raw = open(path, "rb").read()
        (n,) = struct.unpack("<Q", raw[:8])
        assert n % 8 == 0 and raw[8 + n - 1:8 + n] in (b" ", b"}"), n
        header = json.loads(raw[8:8 + n])
        end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
        assert len(raw) == 8 + n + end
        back = read_safetensors(path)
        for k, t in tensors.items():
            assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k
        m = Model(tiny_config())
        export_model(m, d, "f16")
        m2 = load_model(d)
        for k, t in m.state_dict().items():
            assert torch.equal(m2.state_dict()[k], t.half().float()), k
    print("safetensors: round trip exact, header padded to 8")


if __name__ == "__main__":
    torch.set_num_threads(1)
    check_delta_rule()
    check_model()
    check_safetensors()
    print("selftest: OK")
