"""quantship.fidelity: the one judgement of an INT8 file's outputs against the float model's.

Each rule is pinned on outputs built to need it; the verdict on outputs built to pass, to collapse and
to be constant; bad budgets are refused with the fix.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from quantship.errors import DataRefused
from quantship.fidelity import (
    INCONCLUSIVE,
    MET,
    MIN_DECISIONS,
    MISSED,
    NOT_JUDGED,
    Budget,
    agreement_rule,
    budget_from,
    measure,
    sqnr_db,
)

RNG = np.random.default_rng(0)
LOGITS = RNG.standard_normal((200, 10))


DEFAULT = Budget()


def _judge(reference, output, budget=DEFAULT):
    return measure(["out"], [reference], [output], budget=budget, data="test", runtime="numpy")


def test_rules_follow_the_output_kind():
    softmax = np.exp(LOGITS) / np.exp(LOGITS).sum(-1, keepdims=True)
    assert agreement_rule(LOGITS) == "argmax"  # N x C class scores
    assert agreement_rule(softmax) == "argmax"  # rows that are distributions
    assert agreement_rule(1 / (1 + np.exp(-LOGITS[:, :, None]))) == "threshold 0.5"  # sigmoid maps
    assert agreement_rule(LOGITS[:, :, None]) == "sign"  # signed values that are not class scores
    assert agreement_rule(np.abs(LOGITS[:, :, None]) + 1) == "none"  # a positive regression: SQNR alone


def test_sqnr_is_the_energy_ratio():
    noise = 0.1 * RNG.standard_normal(LOGITS.shape)
    judged = _judge(LOGITS, LOGITS + noise)
    expected = 10 * math.log10((LOGITS ** 2).sum() / (noise ** 2).sum())
    assert judged.sqnr_db == pytest.approx(expected, abs=1e-9)
    assert sqnr_db(1.0, 0.0) == math.inf and sqnr_db(0.0, 1.0) == -math.inf


def test_a_faithful_output_meets_the_default_budget():
    judged = _judge(LOGITS, LOGITS + 0.02 * RNG.standard_normal(LOGITS.shape))
    assert judged.status == MET and judged.worst.agreement > 0.95 and judged.worst.n_decisions == 200


def test_a_collapsed_output_misses_it():
    collapsed = 0.3 * LOGITS + RNG.standard_normal(LOGITS.shape)  # the signal mostly gone (about 0 dB)
    judged = _judge(LOGITS, collapsed)
    assert judged.status == MISSED and judged.sqnr_db < 5.0
    assert "MISSED" in judged.describe()


def test_agreement_misses_only_when_its_interval_is_under_the_minimum():
    """6 of 8 agreeing argmaxes: Wilson 95% reaches 0.93, above 0.9, so not proven under; 120 of 200
    agreeing is, whatever the SQNR."""
    reference = 5.0 * np.eye(3)[[0, 1, 2, 0, 1, 2, 0, 1]]
    two_flipped = 5.0 * np.eye(3)[[0, 1, 2, 0, 1, 2, 1, 0]]
    judged = _judge(reference, two_flipped, Budget(min_sqnr_db=0.0))
    assert judged.worst.agreement == 0.75 and judged.worst.agreement_upper > 0.9 and judged.status == MET
    many = LOGITS.copy()
    many[:80] = many[:80, ::-1]  # 80 of 200 rows reordered: their argmax moves
    judged = _judge(LOGITS, many, Budget(min_sqnr_db=0.0))
    assert judged.worst.agreement < 0.65 and judged.status == MISSED


def test_too_few_decisions_are_reported_not_judged():
    """Under MIN_DECISIONS the agreement proves nothing either way: SQNR alone decides."""
    top = np.arange(2.0, 10.0)[:, None]
    reference = np.hstack([top, top - 0.001, -5 + 0 * top])  # near-ties: every argmax flips at about 80 dB SQNR
    judged = _judge(reference, reference[:, [1, 0, 2]], Budget())
    assert judged.worst.agreement == 0.0 and judged.worst.n_decisions == 8 < MIN_DECISIONS
    assert judged.status == MET


def test_a_constant_reference_is_inconclusive_never_met():
    constant = np.ones((16, 10))
    assert _judge(constant, constant + 1e-3).status == INCONCLUSIVE


def test_no_budget_is_not_judged():
    assert _judge(LOGITS, LOGITS, None).status == NOT_JUDGED


def test_several_outputs_the_worst_decides():
    judged = measure(["a", "b"], [LOGITS, LOGITS], [LOGITS, LOGITS * 0.2], budget=Budget(), data="d", runtime="r")
    assert judged.worst.name == "b" and judged.status == MISSED


@pytest.mark.parametrize("sqnr, agreement, says", [(-1.0, None, "dB"), (math.nan, None, "dB"),
                                                    (None, 1.5, "fraction"), (None, -0.1, "fraction")])
def test_budgets_out_of_range_are_refused(sqnr, agreement, says):
    with pytest.raises(DataRefused, match=says):
        budget_from(sqnr, agreement)


def test_shapes_that_differ_are_refused():
    with pytest.raises(DataRefused, match="not the same model"):
        _judge(LOGITS, LOGITS[:, :5])
