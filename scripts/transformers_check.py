#!/usr/bin/env python3
"""transformers' own modeling code decoding on rewind.DynamicCache, on one device (issues 27 and 32).

For each family, a small randomly initialised model built from its transformers config (no download):

- decode: prefill 12 tokens, then 12 greedy steps with ``past_key_values=rewind.DynamicCache(config=...)``;
  every step's logits against the model run without a cache on the whole sequence so far (max abs difference);
- generate: ``model.generate`` greedy, 16 new tokens, with rewind's cache against transformers' default cache;
- assisted: prompt-lookup speculative decoding (``prompt_lookup_num_tokens=3``) with rewind's cache against plain
  greedy (the tokens must be identical); transformers' own cache is tried too and its outcome reported.

A family whose config or model this transformers does not know is reported and skipped. Prints one line per
check; exits 1 when any check that ran failed.

    PYTHONPATH=build/python python3 scripts/transformers_check.py --device cuda
"""

import argparse
import sys

import torch

import rewind

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
FAMILIES = {
    "llama": {},
    "qwen3": {},
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
                 block_dim=64, block_ff_dim=96),
    "qwen3_next": dict(layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                       linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1),
    "qwen3_5_text": dict(layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                         linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4),
}
TOLERANCE = 1e-4


def build(model_type, device):
    import transformers
    config = transformers.AutoConfig.for_model(model_type, **COMMON, **FAMILIES[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    return model.to(device).eval()


def decode_check(model, prompt):
    cache = rewind.DynamicCache(config=model.config)
    ids = prompt
    worst = 0.0
    out = model(ids, past_key_values=cache, use_cache=True)
    for _ in range(12):
        full = model(ids, use_cache=False).logits[:, -1]
        worst = max(worst, (out.logits[:, -1] - full).abs().max().item())
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=-1)
        out = model(nxt, past_key_values=cache, use_cache=True)
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    try:
        import transformers
    except ImportError:
        sys.exit("transformers_check: transformers is not installed")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}")
    failed = 0
    for model_type in FAMILIES:
        try:
            model = build(model_type, device)
        except Exception as e:  # an unknown family or option in this transformers
            print(f"{model_type:<13} skipped: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        torch.manual_seed(1)
        prompt = torch.randint(0, COMMON["vocab_size"], (1, 12), device=device)
        prompt = torch.cat([prompt, prompt[:, :6]], dim=-1)  # a repeat, for prompt lookup to find
        with torch.no_grad():
            try:
                worst = decode_check(model, prompt)
                ok = worst <= TOLERANCE
                failed += not ok
                print(f"{model_type:<13} decode    {'ok' if ok else 'FAILED'}: max |logits - no-cache| {worst:.2e}")
            except Exception as e:
                failed += 1
                print(f"{model_type:<13} decode    FAILED: {type(e).__name__}: {e}")
            try:
                want = model.generate(prompt, max_new_tokens=16, do_sample=False)
                got = model.generate(prompt, max_new_tokens=16, do_sample=False,
                                     past_key_values=rewind.DynamicCache(config=model.config))
                ok = torch.equal(want, got)
                failed += not ok
                print(f"{model_type:<13} generate  {'ok' if ok else 'FAILED'}: rewind's cache vs transformers' default")
                got = model.generate(prompt, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=3,
                                     past_key_values=rewind.DynamicCache(config=model.config))
                ok = torch.equal(want, got)
                failed += not ok
                print(f"{model_type:<13} assisted  {'ok' if ok else 'FAILED'}: prompt lookup on rewind's cache vs greedy")
                try:
                    theirs = model.generate(prompt, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=3)
                    print(f"{model_type:<13} assisted  (transformers' own cache: "
                          f"{'identical to greedy' if torch.equal(want, theirs) else 'DIVERGES from greedy'})")
                except Exception as e:
                    print(f"{model_type:<13} assisted  (transformers' own cache refused: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]})")
            except Exception as e:
                failed += 1
                print(f"{model_type:<13} generate  FAILED: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
