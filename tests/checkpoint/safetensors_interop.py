#!/usr/bin/env python3
"""An independent safetensors reader/writer (json, struct, numpy only), to
check hp::checkpoint against the format rather than against itself.

  describe FILE OUT.json   read FILE, checking what the Python package checks,
                           and write its metadata and tensors (values flattened)
  write FILE OUT.json      write a fixed set of tensors to FILE in Python's own
                           way (header in reverse data order, spaced JSON,
                           padded to 64 bytes), and describe it to OUT.json
"""
import json, struct, sys
import numpy as np

NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4",
         "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}

def read(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header, buf = json.loads(data[8:8 + n]), data[8 + n:]
    meta = header.pop("__metadata__", {})
    entries = sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"]))
    end = 0
    for name, info in entries:
        begin, stop = info["data_offsets"]
        assert begin == end, f"{name}: data starts at {begin}, previous ended at {end}"
        end = stop
    assert end == len(buf), f"data ends at {end} but the buffer has {len(buf)} bytes"
    tensors = [(name, info["dtype"], np.frombuffer(buf[info["data_offsets"][0]:info["data_offsets"][1]],
                dtype=NUMPY[info["dtype"]]).reshape(info["shape"])) for name, info in entries]
    return tensors, meta, n

def describe(tensors, meta, n):
    def values(dtype, a):  # bf16 widened to the float32 with the same leading bits
        return ((a.astype("<u4") << 16).view("<f4") if dtype == "BF16" else a).reshape(-1).tolist()
    return {"metadata": meta, "data_start": 8 + n, "tensors": [
        {"name": name, "dtype": dtype, "shape": list(a.shape), "values": values(dtype, a)}
        for name, dtype, a in tensors]}

def write(path):
    bf16 = (np.array([1.0, -2.5, 3.140625, 1e30], "<f4").view("<u4") >> 16).astype("<u2")
    tensors = [("f64", "F64", np.array([[0.1, -2.0], [1e300, 3.0]])), ("bf16", "BF16", bf16),
               ("f32", "F32", np.arange(6, dtype="<f4").reshape(2, 3) / 7), ("f16", "F16", np.array([0.5, -65504], "<f2")),
               ("i64", "I64", np.array([-(2**62), 7])), ("i32", "I32", np.array([[-5], [2**31 - 1]], "<i4")),
               ("i16", "I16", np.array([-32768, 1], "<i2")), ("i8", "I8", np.array([-128, 127], "i1")),
               ("u8", "U8", np.array([0, 255], "u1")), ("bool", "BOOL", np.array([True, False, True])),
               ("empty", "F32", np.zeros((0, 3), "<f4")), ("scalar", "I64", np.array(42))]
    header, blobs, offset = {}, [], 0
    for name, dtype, a in tensors:
        blob = np.ascontiguousarray(a, NUMPY[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header = dict(reversed(list(header.items())), __metadata__={"format": "pt", "writer": "python"})
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))

if __name__ == "__main__":
    command, path, out = sys.argv[1:4]
    if command == "write":
        write(path)
    with open(out, "w") as f:
        json.dump(describe(*read(path)), f)
