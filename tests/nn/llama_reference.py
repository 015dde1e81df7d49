#!/usr/bin/python3
"""PyTorch reference for hp::nn::Llama (tests/nn/llama_parity_test.cpp).

A Llama (Hugging Face's LlamaForCausalLM, written in plain torch: RMSNorm,
rotate_half rotary embedding, grouped-query causal attention, SwiGLU MLP, no
biases, untied head) with the same parameter names as the C++ model. Usage:
llama_reference.py DIR, where DIR holds

  config.json   model config, "seed", "adamw" hyper-parameters
  inputs.json   (+ .bin) every parameter by name, "idx" and "targets"

in the raw format of tests/nn/raw_tensors.h. It writes outputs.json (+ .bin):

  init.<name>          the parameters this model initialises under
                       torch.manual_seed(seed) (float32)

and, for each DTYPE in float32 and float64, with the loaded parameters
converted to DTYPE:

  DTYPE.logits, DTYPE.loss   forward on idx / targets
  DTYPE.grad.<name>          d loss / d parameter
  DTYPE.step.<name>          the parameters after one AdamW step
  DTYPE.step.loss            the loss on the same batch after that step

Exit status 3 with a message when torch or numpy cannot be imported.
"""
import json
import math
import os
import sys

try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:
    sys.stderr.write(f"llama_reference.py: cannot import {e.name} ({e}); "
                     "install python3-torch and python3-numpy (scripts/install-deps.sh)\n")
    sys.exit(3)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_reference import read_tensors, write_tensors, loss_of, forward_backward_step  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Hugging Face normalises in float32; float64 stays float64.
        dtype = x.dtype
        h = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotary_tables(T, head_dim, theta, dtype):
    # Computed in float64, rounded once (hp/nn/rotary.h).
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    b, kv, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, nh, nkv = cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"]
        self.nh, self.nkv, self.hd, self.theta = nh, nkv, d // nh, cfg["rope_theta"]
        self.q_proj = nn.Linear(d, nh * self.hd, bias=False)
        self.k_proj = nn.Linear(d, nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(nh * self.hd, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = rotary_tables(T, self.hd, self.theta, x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = repeat_kv(k, self.nh // self.nkv)
        v = repeat_kv(v, self.nh // self.nkv)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, self.nh * self.hd)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, m = cfg["n_embd"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(d, m, bias=False)
        self.up_proj = nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg["n_embd"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["n_embd"], cfg["rms_norm_eps"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["n_embd"])
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["n_layer"]))
        self.norm = RMSNorm(cfg["n_embd"], cfg["rms_norm_eps"])

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        state = torch.get_rng_state()
        self.model = Model(cfg)
        self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)
        # The construction's own draws are discarded (hp/nn/llama.h), then
        # Hugging Face's _init_weights in parameter order.
        torch.set_rng_state(state)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, cfg["initializer_range"])

    def forward(self, idx):
        return self.lm_head(self.model(idx))


def main(directory):
    torch.set_num_threads(1)
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    inputs = read_tensors(directory, "inputs")
    idx, targets = inputs.pop("idx"), inputs.pop("targets")

    torch.manual_seed(cfg["seed"])
    model = Llama(cfg)
    out = {"init." + n: p.detach().clone() for n, p in model.named_parameters()}
    assert not list(model.buffers()), "the state dict must hold parameters only"

    for prefix, dtype in (("float32.", torch.float32), ("float64.", torch.float64)):
        model.load_state_dict(inputs, strict=True)
        model.zero_grad(set_to_none=True)
        model.to(dtype)
        results = forward_backward_step(model, idx, targets, cfg)
        out.update({prefix + n: t for n, t in results.items()})
    write_tensors(directory, "outputs", out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: llama_reference.py DIR")
    main(sys.argv[1])
