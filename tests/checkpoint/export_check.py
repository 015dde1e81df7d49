#!/usr/bin/python3
"""Reads an exported weights file with PyTorch 1.13 (C3): the file through
the independent safetensors reader (safetensors_interop.py), the tensors
into the PyTorch GPT of tests/nn/gpt_reference.py by name (strict: every
name and shape must be GPT-2's), and a forward pass on given tokens.

  export_check.py FILE CONFIG.json OUT.json

CONFIG.json holds the model config (vocab_size, context, n_layer, n_head,
n_embd), "idx" and "targets" (lists of lists of token ids). OUT.json gets
"loss" (the mean cross-entropy, float32, as a double) and "names" (the file's
tensors in file order).
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "nn"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gpt_reference  # noqa: E402
import safetensors_interop  # noqa: E402

path, config_path, out_path = sys.argv[1:4]
with open(config_path) as f:
    cfg = json.load(f)
tensors, _, _ = safetensors_interop.read(path)
state = {name: torch.from_numpy(np.array(a, copy=True)) for name, _, a in tensors}
model = gpt_reference.GPT(cfg)
model.load_state_dict(state, strict=True)
with torch.no_grad():
    logits = model(torch.tensor(cfg["idx"], dtype=torch.long))
    loss = gpt_reference.loss_of(logits, torch.tensor(cfg["targets"], dtype=torch.long))
with open(out_path, "w") as f:
    json.dump({"loss": float(loss.item()), "names": [name for name, _, _ in tensors]}, f)
