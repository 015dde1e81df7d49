#!/usr/bin/python3
"""PyTorch reference for hp::nn::GPT (tests/nn/gpt_parity_test.cpp).

A GPT-2 (nanoGPT) in PyTorch 1.13 with the same parameter names as the C++
model. Usage: gpt_reference.py DIR, where DIR holds

  config.json   model config, "seed", "adamw" hyper-parameters
  inputs.json   (+ .bin) every parameter by name, "idx" and "targets"

in the raw format of tests/nn/raw_tensors.h. It writes outputs.json (+ .bin):

  init.<name>          the parameters this model initialises under
                       torch.manual_seed(seed) (float32)

and, for each DTYPE in float32 and float64, with the loaded parameters
converted to DTYPE (model.to(DTYPE) after load_state_dict, as the C++ side
does):

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
    sys.stderr.write(f"gpt_reference.py: cannot import {e.name} ({e}); "
                     "install python3-torch and python3-numpy (scripts/install-deps.sh)\n")
    sys.exit(3)

DTYPES = {"float32": "<f4", "float64": "<f8", "int64": "<i8"}


def read_tensors(directory, stem):
    with open(os.path.join(directory, stem + ".json")) as f:
        index = json.load(f)
    out = {}
    for e in index["tensors"]:
        a = np.fromfile(os.path.join(directory, e["file"]), dtype=DTYPES[e["dtype"]])
        out[e["name"]] = torch.from_numpy(a.reshape(e["shape"]))
    return out


def write_tensors(directory, stem, tensors):
    entries = []
    for i, (name, t) in enumerate(tensors.items()):
        a = t.detach().contiguous().numpy()
        dtype = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64",
                 np.dtype(np.int64): "int64"}[a.dtype]
        file = f"{stem}-{i}.bin"
        a.astype(DTYPES[dtype], copy=False).tofile(os.path.join(directory, file))
        entries.append({"name": name, "dtype": dtype, "shape": list(a.shape), "file": file})
    with open(os.path.join(directory, stem + ".json"), "w") as f:
        json.dump({"tensors": entries}, f)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["n_embd"]
        self.n_head = cfg["n_head"]
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        future = torch.ones(T, T, dtype=torch.bool, device=att.device).triu(1)
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["n_embd"]
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["n_embd"]
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["n_embd"]
        self.wte = nn.Embedding(cfg["vocab_size"], d)
        self.wpe = nn.Embedding(cfg["context"], d)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        self.lm_head = nn.Linear(d, cfg["vocab_size"], bias=False)
        # nanoGPT's initialisation.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg["n_layer"]))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, dtype=torch.long, device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def forward_backward_step(model, idx, targets, cfg):
    """Forward, backward and one AdamW step of `model` in its current dtype."""
    out = {}
    logits = model(idx)
    loss = loss_of(logits, targets)
    loss.backward()
    out["logits"] = logits.detach().clone()
    out["loss"] = loss.detach().clone()
    out.update({"grad." + n: p.grad.clone() for n, p in model.named_parameters()})

    a = cfg["adamw"]
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], betas=(a["beta1"], a["beta2"]),
                            eps=a["eps"], weight_decay=a["weight_decay"])
    opt.step()
    out.update({"step." + n: p.detach().clone() for n, p in model.named_parameters()})
    with torch.no_grad():
        out["step.loss"] = loss_of(model(idx), targets)
    return out


def main(directory):
    torch.set_num_threads(1)
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    inputs = read_tensors(directory, "inputs")
    idx, targets = inputs.pop("idx"), inputs.pop("targets")

    torch.manual_seed(cfg["seed"])
    model = GPT(cfg)
    out = {"init." + n: p.detach().clone() for n, p in model.named_parameters()}

    for prefix, dtype in (("float32.", torch.float32), ("float64.", torch.float64)):
        model.load_state_dict(inputs, strict=True)
        model.zero_grad(set_to_none=True)
        model.to(dtype)
        results = forward_backward_step(model, idx, targets, cfg)
        out.update({prefix + n: t for n, t in results.items()})
    write_tensors(directory, "outputs", out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: gpt_reference.py DIR")
    main(sys.argv[1])
