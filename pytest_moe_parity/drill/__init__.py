"""Below a component: its forward op by op on the reference and on the candidate, the op that
introduced the divergence, how much substituting its golden output recovers, and a repro file.

The reference is the golden's model on this machine (as weight items need it), run in float32 on the
point's recorded inputs and again in the candidate's dtype (every op's noise floor), captured op by
op (`capture`). The candidate is the backend's module for the point (`Backend.drill_call`), run on the
same inputs; a backend that compiles runs each op again through its compiler (`Backend.op_runner`),
on its own earlier outputs (chained) and on the reference's (isolated). `match` pairs the two sides'
ops (`rows` first puts the rows of a port's expert gathers in the reference's order, `cache` takes a
static cache's live slots), `engine` judges them, `verdicts` says what the table means (the culprit,
the structure, why no op explains it), `made` compares the values the candidate makes inside the call
(positions, masks, tables) with the golden's of the same meaning, and `groups` makes the culprit the
group where one op introduced error in many experts, and says which tokens an expert that ran on other
rows than the reference's dropped, took twice or took wrongly."""

from ..report.drill import REPRODUCE_TOL, Drill, OpRow
from .driller import AUTO, Driller, DrillError, drill_patterns, selects

__all__ = ["AUTO", "REPRODUCE_TOL", "Drill", "DrillError", "Driller", "OpRow", "drill_patterns", "selects"]
