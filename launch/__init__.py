"""The recipes: FSDP2 and DeepSpeed training (not part of the flashdist package); launch/bench/: the benchmarks
and measurements.

Each file runs as a module from the repository root (``python -m launch.train``, ``python -m launch.bench.bench_step``)
or as a file (``python launch/train.py``, ``torchrun launch/train.py``). Run as a file, a recipe imports the
flashdist that is installed (``launch/setup.sh`` installs the checkout in editable mode); run as a module from
the repository root, it imports the checkout's.
"""
