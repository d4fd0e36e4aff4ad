"""The stage contract. A stage is an object the `StageRunner` (app/scans/runner.py) runs:
it declares its name, its share of the stream's progress bar, its time limit and the
upstream calls it makes (admission counts them as owed until the stage starts), and
`run(ctx)` returns its result, raising only errors from the error tree (a stage maps its
own failures: the database stages their database errors).

Adding a stage: write a module here with a class that satisfies `Stage`, put its result
type in `results.py` (and a typed accessor on `ScanContext` if a later stage reads it),
and add it to the list in `app/resources.py`. Events, timings, metrics, deadlines and
admission accounting come from the runner.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from app.stages.context import ScanContext

R = TypeVar("R")


class Stage(Protocol[R]):
    name: str
    progress_share: int  # relative width of this stage on the 0-100 progress bar
    timeout_s: float
    upstream_calls: int  # OpenAI calls per run (retries are not new calls)

    async def run(self, ctx: ScanContext) -> R: ...

    def event_fields(self, result: R) -> dict[str, Any]:
        """What the stage's `completed` event carries."""
        ...

    def result_fields(self, result: R) -> dict[str, Any]:
        """What the stage adds to the scan's result (the `done` event and the row)."""
        ...

    def queue_seconds(self, result: R) -> float:
        """Of the stage's time, how much was spent waiting for a gate or the budget."""
        ...
