"""pytest-moe-parity: layer-by-layer parity tests of ported MoE LLMs against a recorded golden run.

The package is layered; a module imports only from the layers before its own:

errors <- points, dtypes, tree, compat, files, host, formats, words <- golden, judge, model <- report <- record, dump <- backends <- replay <- drill <- session, scan, routes <- sweep <- plugin, cli

- errors: the error classes, below everything (every user error is a `ParityError`: `moe-parity`
  says it in one line, the plugin a setup one as a usage error)
- points, dtypes, tree: point ids and forward order, dtype names, nested call structures (no torch
  needed at import); compat: transformers 4.57 and 5 reading one config; files: files written whole
  or not at all; host: the process's state (threads, heap, collector); formats: quantized weights'
  number formats (e4m3, int8, e2m1) and scale grids, shared by `model.quant` and `judge.quant_weights`;
  words: a count said with its noun ("1 point", "3 points")
- golden: the recorded call format and the golden store (write and read); judge: metrics,
  tolerances and verdicts; model: what recording and replay share: where capture points live in a
  model, a checkpoint's index and headers, loading it one unit (decoder layer or model-level module)
  at a time, and a module call's KV cache and outputs
- report: the rows of a run (one per item) and the drill's record (`report.drill`), failure text,
  summary, JSON reports (`report.schema`) and the page, from verdicts alone: every item kind above
  writes its rows with it
- record: capturing the reference (`moe-parity golden`), tiny models, `moe-parity audit` and
  `estimate`; dump: a recorder that any framework's candidate calls, writing what `--hw dump` reads;
  backends: candidates (`--hw`); replay: one point run on a backend and judged, the checkers of the
  items beside the points (`replay.checks`), the weight items
- drill: below a point, op by op (`--parity-drill`): both sides' ops captured and matched, the op that
  introduced the divergence, golden substitution, repro files, the drill's items
- session: a whole parity run without pytest, composing the item checkers (`CHECKERS`); scan: prompts ranked by
  how far a candidate's next tokens leave the reference's (`moe-parity scan`); routes: an engine's
  routed-experts trace against the golden's routing (`moe-parity routes`); sweep: a candidate over a
  length sweep's goldens, accumulation or a defect (`moe-parity sweep`)
- plugin: the pytest glue; cli: the `moe-parity` command, a package by family of commands
"""

__version__ = "0.1.0"
