"""Repository-level test configuration: keep thread counts small on the 2-core CI machine."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The inner sessions of the tests (pytester, subprocesses) replay a golden against itself on purpose, and
# CI=true (GitHub Actions sets it) makes such a run a usage error (`replay.vacuous`): the tests that
# want it set it themselves.
os.environ.pop("CI", None)
