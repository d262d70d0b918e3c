"""pytest-moe-parity: layer-by-layer parity tests of ported MoE LLMs against a recorded golden run.

The package is layered; a module imports only from the layers before its own:

points, dtypes, errors, tree, compat <- golden, judge <- record, dump <- backends <- replay <- report <- session <- plugin, cli

- points, dtypes, errors, tree: point ids and forward order, dtype names, the error classes, nested
  call structures (no torch needed at import); compat: transformers 4.57 and 5 reading one config
- golden: the recorded call format and the golden store (write and read); judge: metrics,
  tolerances and verdicts
- record: where capture points live in a model, loading a checkpoint one unit (decoder layer or
  model-level module) at a time, and capturing the reference (`moe-parity golden`);
  dump: a recorder that any framework's candidate calls, writing what `--hw dump` reads;
  backends: candidates (`--hw`); replay: one point run on a backend and judged
- report: failure text, summary and JSON reports; session: a whole parity run without pytest
- plugin: the pytest glue; cli: the `moe-parity` command
"""

__version__ = "0.1.0"
