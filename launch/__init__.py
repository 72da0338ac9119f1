"""The recipes: FSDP2 and DeepSpeed training, benchmarks and measurements (not part of the flashdist package).

Each file runs as a module from the repository root (``python -m launch.train``, ``torchrun -m launch.train``)
or as a file (``python launch/train.py``, ``torchrun launch/train.py``). Run as a file, a recipe imports the
flashdist that is installed (``launch/setup.sh`` installs the checkout in editable mode); run as a module from
the repository root, it imports the checkout's.
"""
