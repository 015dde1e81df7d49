#!/usr/bin/env python3
"""Compiles each file of a configured build with -fsyntax-only, on its own
includes: the commands of the build's compile_commands.json without the
precompiled header, the object and the dependency file. A file that leans on
the precompiled header for an #include fails here. A unity source of the build
(CMake's Unity/unity_N_cxx.cxx) stands for the files it includes: each is
checked on its own with the unity source's flags.

With --batches, each entry of compile_commands.json is checked as the build
compiles it instead: a unity source as one compile of its batch (still
without the precompiled header). It checks the same code against the same
headers at about a third of the cost (libtorch's headers are parsed once a
batch, not once a file), but a file may then lean on an #include of an
earlier file of its batch.

Usage: syntax-check.py [-j N] [--batches] [--logs DIR] BUILD_DIR [PATH...]
  PATH  files or directories (relative to the repository) to check; default:
        every project source file of the build (with --batches: every batch
        that holds one of them)
Prints "FAIL <file>" for each failure and its first 40 lines of diagnostics,
then one summary line; exit status 1 if any file failed.
"""
import argparse
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import time


def syntax_only(args, unit, source):
    """The compile command `args` of the file argument `unit`, as
    -fsyntax-only of `source` (the unit itself or a file a unity unit
    includes) without the PCH."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-include") and i + 1 < len(args):
            skip = True  # the object, the dependency file, the precompiled header
            continue
        if a in ("-c", "-MD", "-Winvalid-pch"):
            continue
        if a == unit:
            a = source
        out.append(a)
    return out + ["-fsyntax-only"]


UNITY_INCLUDE = re.compile(r'^#include "(.+)"$')


def sources_of(path):
    """The project files a compile_commands.json entry compiles: a unity source
    stands for the files it includes; any other entry for itself."""
    if os.path.basename(os.path.dirname(path)) != "Unity":
        return [path]
    with open(path) as f:
        return [m.group(1) for m in map(UNITY_INCLUDE.match, f.read().splitlines()) if m]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batches", action="store_true",
                        help="one check per compile_commands.json entry (a unity batch as one)")
    parser.add_argument("--logs", help="where failing files' diagnostics go (default: BUILD_DIR/syntax-logs)")
    parser.add_argument("build_dir")
    parser.add_argument("paths", nargs="*")
    a = parser.parse_args()

    root = os.getcwd()
    commands = os.path.join(a.build_dir, "compile_commands.json")
    if not os.path.exists(commands):
        sys.exit(f"syntax-check: {commands} does not exist: configure {a.build_dir} first")
    wanted = [os.path.normpath(p) for p in a.paths]

    build_rel = os.path.relpath(a.build_dir, root) + os.sep

    def selected(rel):
        # Outside the project; the PCH anchors; CMake's sources of the PCHs
        # (empty once their -include is gone).
        if rel.startswith(("..", "cmake/", build_rel)):
            return False
        return not wanted or any(rel == w or rel.startswith(w + os.sep) for w in wanted)

    entries, files = [], 0
    for e in json.load(open(commands)):
        unit = os.path.abspath(os.path.join(e["directory"], e["file"]))
        args = e.get("arguments") or shlex.split(e["command"])
        rels = [os.path.relpath(path, root) for path in sources_of(unit)]
        if a.batches:
            if any(map(selected, rels)):
                # A batch is named by its first file (and how many it holds).
                name = rels[0] + (f" (+{len(rels) - 1} of its batch)" if len(rels) > 1 else "")
                entries.append((name, e["directory"], syntax_only(args, e["file"], e["file"])))
                files += len(rels)
            continue
        for path, rel in zip(sources_of(unit), rels):
            if selected(rel):
                entries.append((rel, e["directory"], syntax_only(args, e["file"], path)))
                files += 1
    entries.sort()

    logs = a.logs or os.path.join(a.build_dir, "syntax-logs")
    os.makedirs(logs, exist_ok=True)
    for old in os.listdir(logs):
        os.remove(os.path.join(logs, old))

    def check(item):
        rel, cwd, args = item
        r = subprocess.run(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        if r.returncode != 0:
            with open(os.path.join(logs, rel.split(" ")[0].replace("/", "_") + ".log"), "w") as f:
                f.write(r.stdout)
            print("FAIL " + rel, flush=True)
        return rel, r.returncode, r.stdout

    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(a.j) as pool:
        results = list(pool.map(check, entries))
    failed = [(rel, out) for rel, code, out in results if code != 0]
    for rel, out in failed:
        print("== " + rel)
        print("\n".join(out.splitlines()[:40]))
    what = (f"{files} files of {a.build_dir} in {len(entries)} compiles as the build batches them"
            if a.batches else f"{files} files of {a.build_dir} on their own includes")
    print(f"syntax-check: {what}, {len(failed)} failed, {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
