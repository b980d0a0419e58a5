"""Runs the Python code blocks of one section of a Markdown file, in order, each as a
fresh `__main__` (tests/multirank/test_doc_examples.py): argv FILE HEADING DIR; the blocks
run with DIR as the working directory. Rank 0 writes {"ran": [block numbers]} to --out."""
import argparse
import json
import os
import sys

from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from doc_sections import python_blocks  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("file")
ap.add_argument("heading")
ap.add_argument("dir")
a = ap.parse_args()
blocks = python_blocks(a.file, a.heading)
os.makedirs(a.dir, exist_ok=True)
here = os.getcwd()
os.chdir(a.dir)
ran = []
try:
    for i, src in enumerate(blocks):
        exec(compile(src, f"{os.path.basename(a.file)} '{a.heading}' block {i + 1}", "exec"), {"__name__": "__main__"})
        MPI.COMM_WORLD.Barrier()
        ran.append(i + 1)
finally:
    os.chdir(here)
if MPI.COMM_WORLD.rank == 0:
    with open(a.out, "w") as f:
        json.dump({"ran": ran, "count": len(blocks)}, f)
