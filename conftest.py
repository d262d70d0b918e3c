"""Repository-level test configuration: keep thread counts small on the 2-core CI machine."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
