"""The planner figures the README and docs/planner.md quote are the planner's own: a job is planned
again here and its MFU must appear where the documents state it, so a change to the cost model
that moves a documented figure fails until the documents (and the bench result behind them) are
run again. Mixtral-8x7B on 256 H100s, the MoE headline (``bench/plan_moe.py``): one search of
about 10 s on a 2-core host."""

import os

import pytest

from axon4d.plan.search import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _text(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


@pytest.mark.slow
def test_the_documented_mixtral_plan_is_what_the_planner_gives():
    result = plan("mixtral-8x7b", 256, "h100", 1024, top=1)
    best = next(c for c in result.candidates if c.fits)
    figure = f"{100 * best.mfu:.1f}%"
    grid = ", ".join(str(n) for n in best.shape.as_tuple())
    readme = _text("README.md")
    guide = _text("docs/planner.md")
    assert f"Mixtral-8x7B on 256 H100s is predicted at {figure} model MFU" in readme, (
        f"README.md quotes another Mixtral figure than the planner's {figure} on ({grid}): "
        "run bench/plan_moe.py and update README.md and docs/planner.md"
    )
    assert f"on 256 H100s: {figure} model MFU" in guide, f"docs/planner.md: the planner gives {figure} on ({grid})"
    assert f"best: ({grid}) with" in guide, f"docs/planner.md's Mixtral plan is not the planner's best ({grid})"
